use rdma_rpc::rdma_service;

pub struct Handle(u32);

#[rdma_service]
pub trait Store {
    async fn open(&self, name: String) -> Handle;
    async fn close(&self, handle: Handle);
}

fn main() {}
