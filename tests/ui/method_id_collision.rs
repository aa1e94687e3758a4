use rdma_rpc::rdma_service;

// "Collide.m172697" and "Collide.m1830330" have the same 32-bit FNV-1a hash.
#[rdma_service]
pub trait Collide {
    async fn m172697(&self);
    async fn m1830330(&self);
}

fn main() {}
