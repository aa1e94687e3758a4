//! rdma_cm event dispatch: one task per event channel reads its events (fd in tokio's reactor)
//! and routes each to the id it is about (a connect request: to the listening id).

use std::sync::Arc;

use tokio::task::JoinHandle;

use crate::error::RdmaError;
use crate::verbs::{self, CmChannel, CmEvent, CmEventKind};

/// Keeps the dispatch task of one channel alive; the task ends when the last holder drops it.
pub(crate) struct CmDispatcher {
    task: JoinHandle<()>,
    channel: Arc<CmChannel>,
}

impl CmDispatcher {
    /// Opens a new event channel and starts its dispatch task (needs a tokio runtime).
    pub(crate) fn start() -> Result<Arc<CmDispatcher>, RdmaError> {
        let channel = CmChannel::new()?;
        let afd = verbs::async_fd(Arc::clone(&channel))?;
        let task = tokio::spawn(async move {
            loop {
                let mut guard = match afd.readable().await {
                    Ok(g) => g,
                    Err(e) => {
                        tracing::error!("transport-rdma: rdma_cm channel poll failed: {e}");
                        return;
                    }
                };
                loop {
                    match afd.get_ref().0.next_event() {
                        Ok(Some(ev)) => route(ev),
                        Ok(None) => {
                            guard.clear_ready();
                            break;
                        }
                        Err(e) => {
                            tracing::warn!("transport-rdma: {e}");
                            guard.clear_ready();
                            break;
                        }
                    }
                }
            }
        });
        Ok(Arc::new(CmDispatcher { task, channel }))
    }

    pub(crate) fn channel(&self) -> &Arc<CmChannel> {
        &self.channel
    }
}

impl Drop for CmDispatcher {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn route(ev: CmEvent) {
    let target = if ev.kind == CmEventKind::ConnectRequest {
        ev.listener.as_ref()
    } else {
        ev.id.as_ref()
    };
    match target.and_then(|id| id.route()) {
        Some(route) => {
            if let Err(e) = route.send(ev) {
                tracing::debug!(
                    "transport-rdma: rdma_cm event {:?} for a closed id dropped",
                    e.0.kind
                );
            }
        }
        None => tracing::debug!(
            "transport-rdma: unrouted rdma_cm event {:?} (status {})",
            ev.kind,
            ev.status
        ),
    }
}
