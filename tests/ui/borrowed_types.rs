use rdma_rpc::rdma_service;

#[rdma_service]
pub trait Store {
    async fn put(&self, key: &str, value: Vec<u8>);
    async fn get(&self, key: String) -> &'static [u8];
    async fn keys(&self, prefix: impl Into<String>) -> Vec<String>;
    async fn iter(&self) -> Box<impl Iterator<Item = u8>>;
    async fn me(&self) -> Option<Self>;
}

fn main() {}
