//! One poller for what a test waits on: a condition that becomes true while a service works in
//! the background, checked until it holds or a timeout fails the test with what it waited for.

use std::time::Duration;

/// How long [`eventually`] waits between two checks.
pub const POLL: Duration = Duration::from_millis(200);

/// Polls `check` every [`POLL`] until it returns a value and returns that value; panics after
/// `timeout` with `what` (a phrase: "the incident to be resolved"). `check` runs at least once,
/// and once more after the timeout has passed, so a slow check does not lose its last look.
///
/// ```no_run
/// # async fn doc(count: impl AsyncFn() -> usize) {
/// use std::time::Duration;
/// let n = gpumedic_testkit::eventually("two verdicts", Duration::from_secs(30), async || {
///     let n = count().await;
///     (n >= 2).then_some(n)
/// })
/// .await;
/// # }
/// ```
pub async fn eventually<T>(what: &str, timeout: Duration, check: impl AsyncFnMut() -> Option<T>) -> T {
    eventually_or(timeout, check).await.unwrap_or_else(|()| panic!("timed out after {timeout:?} waiting for: {what}"))
}

/// [`eventually`] for a check that also says what it saw: polls `check` until it returns `Ok`,
/// and after `timeout` panics with `what` and the last `Err` (say, "3 of 5 incidents resolved").
pub async fn eventually_with<T, E: std::fmt::Display>(
    what: &str,
    timeout: Duration,
    mut check: impl AsyncFnMut() -> Result<T, E>,
) -> T {
    let mut last = None;
    let found = eventually_or(timeout, async || match check().await {
        Ok(v) => Some(v),
        Err(e) => {
            last = Some(e.to_string());
            None
        }
    })
    .await;
    found.unwrap_or_else(|()| {
        panic!("timed out after {timeout:?} waiting for: {what}; last seen: {}", last.unwrap_or_default())
    })
}

/// Polls `check` every [`POLL`] until it returns a value, or `Err(())` once `timeout` has passed
/// (after one last check), for a caller that does not fail the test on a timeout.
pub async fn eventually_or<T>(timeout: Duration, mut check: impl AsyncFnMut() -> Option<T>) -> Result<T, ()> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let expired = tokio::time::Instant::now() >= deadline;
        if let Some(v) = check().await {
            return Ok(v);
        }
        if expired {
            return Err(());
        }
        tokio::time::sleep(POLL.min(deadline.saturating_duration_since(tokio::time::Instant::now()))).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn returns_the_first_value_the_check_gives() {
        let mut calls = 0;
        let v = eventually("the third call", Duration::from_secs(60), async || {
            calls += 1;
            (calls == 3).then_some(calls)
        })
        .await;
        assert_eq!(v, 3);
    }

    #[tokio::test]
    #[should_panic(expected = "waiting for: nothing; last seen: still 0")]
    async fn fails_with_what_it_waited_for_and_what_it_saw() {
        eventually_with("nothing", Duration::from_millis(300), async || Err::<(), _>("still 0")).await;
    }

    #[tokio::test]
    async fn a_check_that_never_holds_ends_in_an_error() {
        let mut calls = 0;
        let r = eventually_or(Duration::from_millis(300), async || {
            calls += 1;
            None::<()>
        })
        .await;
        assert_eq!(r, Err(()));
        assert!(calls >= 2, "checked at the start and once more at the timeout: {calls}");
    }
}
