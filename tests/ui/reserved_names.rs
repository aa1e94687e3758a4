use rdma_rpc::rdma_service;

#[rdma_service]
pub trait Store {
    async fn connect(&self);
    async fn from_client(&self);
    async fn client(&self);
    async fn with_timeout(&self, millis: u64);
}

fn main() {}
