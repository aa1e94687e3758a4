use rdma_rpc::rdma_service;

#[rdma_service]
pub trait Store {
    async fn by_mut(&mut self);
    async fn by_value(self);
    async fn no_receiver(key: String);
    async fn boxed(self: Box<Self>);
    async fn fine(&self);
}

fn main() {}
