use rdma_rpc::rdma_service;

#[rdma_service]
pub trait Store {
    fn put(&self, key: String) -> u64;
    async fn get(&self, key: String) -> Option<u64>;
}

fn main() {}
