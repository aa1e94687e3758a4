use rdma_rpc::rdma_service;

macro_rules! more_methods {
    () => {};
}

#[rdma_service]
pub trait Store {
    type Key;
    const LIMIT: usize;
    more_methods!();
    async fn ping(&self) {
        println!("pong");
    }
}

fn main() {}
