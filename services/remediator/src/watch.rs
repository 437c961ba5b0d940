//! The remediator's watch caches' shared loop: feed a watch's events to an index until the
//! service stops, warning once when the watch starts failing (kube-runtime's watcher retries with
//! backoff on its own) rather than at every retry. The GPU quarantine's caches
//! ([`crate::dra::cache`]) and the managed fleet's node index ([`crate::fleet`]) use it.

use std::sync::RwLock;

use futures::StreamExt as _;
use kube::Api;
use kube::runtime::WatchStreamExt as _;
use kube::runtime::watcher::{self, Event, watcher};
use tokio_util::sync::CancellationToken;

/// Feeds `api`'s watch events to `on_event` until `token` is cancelled. The first failure of a
/// run of them is logged as a warning with `failing` (what the service does meanwhile); the
/// retries are logged at debug.
pub(crate) async fn follow<K>(
    api: Api<K>,
    config: watcher::Config,
    what: &'static str,
    failing: &'static str,
    token: CancellationToken,
    mut on_event: impl FnMut(Event<K>),
) where
    K: kube::Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned + Send + 'static,
    K::DynamicType: Default,
{
    let mut stream = std::pin::pin!(watcher(api, config).default_backoff());
    let mut failed = false;
    loop {
        tokio::select! {
            () = token.cancelled() => return,
            item = stream.next() => match item {
                None => return,
                Some(Ok(event)) => {
                    failed = false;
                    on_event(event);
                }
                Some(Err(e)) if !failed => {
                    failed = true;
                    tracing::warn!(watch = what, error = %e, "{failing}");
                }
                Some(Err(e)) => tracing::debug!(watch = what, error = %e, "The watch failed again."),
            },
        }
    }
}

/// Reads an index; a panic elsewhere cannot leave an index half written (each event is applied
/// whole under the lock), so a poisoned lock is still safe to read.
pub(crate) fn read<T>(lock: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    lock.read().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Writes an index (see [`read`]).
pub(crate) fn write<T>(lock: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    lock.write().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A resourceVersion as a number, to order two copies of one object (a watch event, a write's
/// answer): the apiserver's are etcd revisions. One that is not a number is never ordered.
pub(crate) fn version(rv: Option<&str>) -> Option<u64> {
    rv.and_then(|v| v.parse().ok())
}
