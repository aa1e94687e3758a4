use rdma_rpc::rdma_service;

#[rdma_service]
pub trait Store<K>
where
    K: Send,
{
    async fn put<V>(&self, value: V);
    async fn get<'a>(&'a self) -> u64;
    async fn scan(&self) -> u64
    where
        Self: Sync;
}

fn main() {}
