use rdma_rpc::rdma_service;

#[rdma_service]
pub struct Store {
    map: Vec<u8>,
}

#[rdma_service]
pub fn store() {}

fn main() {}
