use std::rc::Rc;

use rdma_rpc::rdma_service;

#[rdma_service]
pub trait Store {
    async fn get(&self, key: String) -> u64;
}

struct Local;

impl Store for Local {
    async fn get(&self, key: String) -> u64 {
        let shared = Rc::new(key);
        tokio::task::yield_now().await;
        shared.len() as u64
    }
}

fn main() {}
