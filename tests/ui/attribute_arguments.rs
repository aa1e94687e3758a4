use rdma_rpc::rdma_service;

#[rdma_service(timeout = 5)]
pub trait Store {
    async fn ping(&self);
}

#[rdma_service(codec)]
pub trait Other {
    async fn ping(&self);
}

fn main() {}
