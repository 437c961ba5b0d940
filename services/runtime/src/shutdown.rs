//! The shutdown tree: one cancellation token tied to SIGTERM and SIGINT, every long task spawned
//! under it, any task that ends early cancels the rest, and a deadline bounds the whole shutdown.

use std::future::Future;
use std::time::Duration;

use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::BoxError;

/// Why a service stopped other than by a clean, requested shutdown.
#[derive(Debug, thiserror::Error)]
pub enum ShutdownError {
    /// A task failed; its failure cancelled the rest.
    #[error("task '{task}' failed: {source}")]
    TaskFailed {
        /// The task's name.
        task: String,
        /// Its error.
        source: BoxError,
    },
    /// A task returned while the service was still meant to run.
    #[error("task '{task}' stopped unexpectedly")]
    TaskEnded {
        /// The task's name.
        task: String,
    },
    /// A task panicked.
    #[error("task '{task}' panicked")]
    TaskPanicked {
        /// The task's name.
        task: String,
    },
    /// Tasks were still running when the deadline passed.
    #[error("shutdown deadline of {deadline:?} passed with tasks still running: {pending:?}")]
    DeadlineExceeded {
        /// The deadline.
        deadline: Duration,
        /// The tasks that had not finished.
        pending: Vec<String>,
    },
    /// The signal handlers could not be installed.
    #[error("cannot listen for shutdown signals: {0}")]
    Signals(#[source] std::io::Error),
}

type TaskResult = (String, Result<(), BoxError>);

/// Owns the long-running tasks of a service.
pub struct Shutdown {
    token: CancellationToken,
    tasks: JoinSet<TaskResult>,
    names: Vec<(tokio::task::Id, String)>,
    deadline: Duration,
}

impl Shutdown {
    /// A new tree whose graceful shutdown may take at most `deadline`.
    pub fn new(deadline: Duration) -> Self {
        Self { token: CancellationToken::new(), tasks: JoinSet::new(), names: Vec::new(), deadline }
    }

    /// The token every task watches; cancelled when shutdown begins.
    pub fn token(&self) -> CancellationToken {
        self.token.clone()
    }

    /// Spawns a long-running task. It should return when the token is cancelled; returning
    /// earlier (with or without an error) shuts the service down.
    pub fn spawn<F, E>(&mut self, name: impl Into<String>, task: F)
    where
        F: Future<Output = Result<(), E>> + Send + 'static,
        E: Into<BoxError>,
    {
        let name = name.into();
        let task_name = name.clone();
        let handle = self.tasks.spawn(async move { (task_name, task.await.map_err(Into::into)) });
        self.names.push((handle.id(), name));
    }

    /// Runs until SIGTERM/SIGINT, [`Shutdown::token`] being cancelled, or any task ending; then
    /// cancels everything and waits for the tasks, at most the deadline.
    pub async fn run(mut self) -> Result<(), ShutdownError> {
        let mut sigterm = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .map_err(ShutdownError::Signals)?;
        let mut first_error: Option<ShutdownError> = None;

        tokio::select! {
            _ = sigterm.recv() => tracing::info!(signal = "SIGTERM", "Shutting down on signal."),
            _ = tokio::signal::ctrl_c() => tracing::info!(signal = "SIGINT", "Shutting down on signal."),
            () = self.token.cancelled() => tracing::info!("Shutting down on request."),
            Some(joined) = self.tasks.join_next_with_id() => {
                let err = self.describe(joined, true);
                tracing::error!(error = %err, "A task stopped; shutting down the service.");
                first_error = Some(err);
            }
        }
        self.token.cancel();

        let deadline = tokio::time::sleep(self.deadline);
        tokio::pin!(deadline);
        loop {
            tokio::select! {
                joined = self.tasks.join_next_with_id() => match joined {
                    None => break,
                    Some(joined) => {
                        let err = self.describe(joined, false);
                        if !matches!(err, ShutdownError::TaskEnded { .. }) {
                            tracing::warn!(error = %err, "A task failed while shutting down.");
                            first_error.get_or_insert(err);
                        }
                    }
                },
                () = &mut deadline => {
                    let pending: Vec<String> = self.names.iter().map(|(_, n)| n.clone()).collect();
                    self.tasks.abort_all();
                    return Err(first_error.unwrap_or(ShutdownError::DeadlineExceeded { deadline: self.deadline, pending }));
                }
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => {
                tracing::info!("All tasks stopped; shutdown complete.");
                Ok(())
            }
        }
    }

    /// Turns a joined task into the error it stands for; `early` means the service was not
    /// shutting down when it ended, so even a clean return is an error.
    fn describe(
        &mut self,
        joined: Result<(tokio::task::Id, TaskResult), tokio::task::JoinError>,
        early: bool,
    ) -> ShutdownError {
        match joined {
            Ok((id, (task, result))) => {
                self.names.retain(|(i, _)| *i != id);
                match result {
                    Err(source) => ShutdownError::TaskFailed { task, source },
                    Ok(()) if early => ShutdownError::TaskEnded { task },
                    Ok(()) => {
                        tracing::debug!(%task, "Task stopped.");
                        ShutdownError::TaskEnded { task }
                    }
                }
            }
            Err(join_error) => {
                let id = join_error.id();
                let task = self.names.iter().find(|(i, _)| *i == id).map(|(_, n)| n.clone()).unwrap_or_default();
                self.names.retain(|(i, _)| *i != id);
                ShutdownError::TaskPanicked { task }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_failing_task_cancels_the_others() {
        let mut tree = Shutdown::new(Duration::from_secs(5));
        let token = tree.token();
        tree.spawn("waits", async move {
            token.cancelled().await;
            Ok::<_, BoxError>(())
        });
        tree.spawn("fails", async { Err::<(), BoxError>("boom".into()) });
        let err = tree.run().await.expect_err("a task failed");
        assert!(matches!(err, ShutdownError::TaskFailed { ref task, .. } if task == "fails"), "{err}");
    }

    #[tokio::test]
    async fn cancellation_stops_cleanly() {
        let mut tree = Shutdown::new(Duration::from_secs(5));
        let token = tree.token();
        let t2 = tree.token();
        tree.spawn("waits", async move {
            t2.cancelled().await;
            Ok::<_, BoxError>(())
        });
        token.cancel();
        tree.run().await.expect("clean shutdown");
    }

    #[tokio::test]
    async fn a_task_that_ignores_cancellation_hits_the_deadline() {
        let mut tree = Shutdown::new(Duration::from_millis(100));
        let token = tree.token();
        tree.spawn("stubborn", async {
            tokio::time::sleep(Duration::from_secs(3600)).await;
            Ok::<_, BoxError>(())
        });
        token.cancel();
        let err = tree.run().await.expect_err("deadline");
        assert!(
            matches!(err, ShutdownError::DeadlineExceeded { ref pending, .. } if pending == &["stubborn".to_string()]),
            "{err}"
        );
    }

    #[tokio::test]
    async fn a_panicking_task_is_reported() {
        let mut tree = Shutdown::new(Duration::from_secs(5));
        tree.spawn("panics", async {
            panic!("on purpose");
            #[allow(unreachable_code)]
            Ok::<_, BoxError>(())
        });
        let err = tree.run().await.expect_err("panic");
        assert!(matches!(err, ShutdownError::TaskPanicked { ref task } if task == "panics"), "{err}");
    }
}
