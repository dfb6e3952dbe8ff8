//! The in-process relay: the streamed flex requests this `serve` holds,
//! by message id, each with the channel its events go into.
//!
//! `serve` subscribes before it enqueues (so no event can come before
//! the route), and its subscription's drop takes the route away. Two
//! writers feed a route: a dispatcher in the same process (it finds the
//! id here and sends directly), and the Redis reader (`super::redis`)
//! for a dispatcher elsewhere.
//!
//! Unbounded channels, on purpose: an engine's stream must never wait on
//! a slow client (the engine's slot is the scarce thing, and it is freed
//! when the engine finishes), and what a channel holds is bounded anyway
//! by the attempt's body limit (`gateway.max_response_bytes`), which the
//! dispatcher holds a copy of for the record.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::{Notify, mpsc};

use super::Event;

/// The routes of one process.
#[derive(Debug, Default)]
pub struct LocalRelay {
    routes: Mutex<HashMap<String, mpsc::UnboundedSender<Event>>>,
    /// Fired when a route is added (the Redis reader reads its stream).
    added: Notify,
}

/// One held streamed request's route; dropping it removes the route, and
/// a dispatcher relaying to it sees it closed.
#[derive(Debug)]
pub struct Subscription {
    relay: Arc<LocalRelay>,
    id: String,
    rx: mpsc::UnboundedReceiver<Event>,
}

impl Subscription {
    /// The next event (pending forever once every writer is gone: the
    /// record ends the stream then).
    pub async fn next(&mut self) -> Event {
        match self.rx.recv().await {
            Some(event) => event,
            None => std::future::pending().await,
        }
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        self.relay.lock().remove(&self.id);
    }
}

impl LocalRelay {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, mpsc::UnboundedSender<Event>>> {
        self.routes.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A route for `id`.
    pub fn subscribe(self: &Arc<Self>, id: &str) -> Subscription {
        let (tx, rx) = mpsc::unbounded_channel();
        self.lock().insert(id.to_owned(), tx);
        self.added.notify_one();
        Subscription {
            relay: self.clone(),
            id: id.to_owned(),
            rx,
        }
    }

    /// Where `id`'s events go, while it is held here.
    pub fn sender(&self, id: &str) -> Option<mpsc::UnboundedSender<Event>> {
        self.lock().get(id).cloned()
    }

    /// Every id held now.
    pub fn ids(&self) -> Vec<String> {
        self.lock().keys().cloned().collect()
    }

    /// Resolves when a route is added after the last call (or one was
    /// added since).
    pub async fn added(&self) {
        self.added.notified().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_route_lives_as_long_as_its_subscription() {
        let relay = Arc::new(LocalRelay::default());
        let mut sub = relay.subscribe("flex_1");
        let tx = relay.sender("flex_1").expect("held");
        tx.send(Event::End {
            attempt: 1,
            chunks: 0,
            error: None,
        })
        .expect("open");
        assert!(matches!(sub.next().await, Event::End { attempt: 1, .. }));
        assert_eq!(relay.ids(), vec!["flex_1".to_owned()]);
        drop(sub);
        assert!(relay.sender("flex_1").is_none());
        assert!(tx.is_closed(), "the writer sees the holder gone");
    }
}
