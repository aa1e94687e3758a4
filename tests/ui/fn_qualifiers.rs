use rdma_rpc::rdma_service;

#[rdma_service]
pub trait Store {
    async unsafe fn put(&self);
    async extern "C" fn get(&self);
    const fn len(&self) -> usize;
}

fn main() {}
