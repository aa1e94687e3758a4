use rdma_rpc::rdma_service;

#[rdma_service]
pub trait Store {
    async fn pair(&self, (a, b): (u8, u8));
    async fn ignored(&self, _: u8);
    async fn mutable(&self, mut key: String);
    async fn attributed(&self, #[allow(unused)] key: String);
}

fn main() {}
