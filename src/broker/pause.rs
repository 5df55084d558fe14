//! Pausing a consumer while a dependency of its handler fails (a circuit
//! breaker): [`PausePolicy`] says when, [`Breaker`] keeps the state that
//! every worker of one consumer shares.
//!
//! The rule, which [`PausePolicy`] documents for users:
//!
//! | state | a delivery about to start | its attempt fails (retryable, not the database) | its attempt succeeds (the handler ran and committed) |
//! |---|---|---|---|
//! | running | starts | counted; the consumer pauses if the last `window` counted attempts (at least `min_attempts`) failed at `failure_rate` or more, and then the delivery is held | counted |
//! | paused (cool-down) | waits | held | (late) not counted |
//! | probing (after the cool-down) | the first one starts as the probe; the others wait | the probe's failure pauses again for a cool-down; it is held | the probe's success resumes consuming and empties the window |
//!
//! A held delivery waits, is not counted as an attempt of its retry policy
//! and is never dead-lettered for the outage; it runs again when the
//! breaker lets it. Duplicates, stale deliveries, rejections, conflicts,
//! permanent errors and database outages (which wait on their own, see
//! [`Decision::Wait`](crate::engine::Decision::Wait)) say nothing about the
//! dependency: they are not counted, and a probe that ends with one of them
//! hands the probe to the next delivery.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use metrics::{Counter, Gauge};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::engine::{Decision, Failure, Outcome, RetryPolicy, Telemetry, decide};
use crate::sync::lock;

/// The largest [`PausePolicy::window`].
const MAX_WINDOW: u32 = 10_000;
/// The longest [`PausePolicy::cool_down`].
const MAX_COOL_DOWN: Duration = Duration::from_secs(24 * 3600);

/// When a consumer pauses because its handler keeps failing (a payment
/// API down, say), instead of retrying every message to exhaustion and
/// flooding the dead-letter queue: a circuit breaker over the handler's
/// attempts, set with
/// [`KafkaConsumerBuilder::pause_on_failure`](crate::kafka::KafkaConsumerBuilder::pause_on_failure)
/// or [`AmqpConsumerBuilder::pause_on_failure`](crate::amqp::AmqpConsumerBuilder::pause_on_failure).
///
/// The consumer pauses once, of its last [`window`](Self::window)
/// counted attempts (and at least [`min_attempts`](Self::min_attempts)),
/// the share that failed reaches [`failure_rate`](Self::failure_rate).
/// Counted: attempts whose handler failed with a retryable error (a
/// [`HandlerError::retryable`](crate::HandlerError::retryable), a panic, a
/// refusal at commit), handlers given up at the transaction deadline too
/// often ([`Failure::Deadline`](crate::Failure::Deadline): a dependency
/// that hangs), and attempts whose handler ran and committed (each record
/// of a committed Kafka batch). Everything else says nothing about the
/// dependency and is not counted. The rate is over every handler outcome,
/// not only calls to one dependency: on a topic where a third of the
/// messages call the failing API, a third of the attempts fail; set the
/// rate accordingly. Each consumer counts its own attempts, in memory.
///
/// While paused:
/// - no delivery starts (Kafka pauses fetching from its partitions; AMQP
///   takes no delivery beyond those already in hand, and the channel's
///   prefetch bounds what the broker sends);
/// - a delivery whose attempt fails is held: not counted as an attempt of
///   the [retry policy](crate::RetryPolicy), never retried through a
///   retry topic or queue, never dead-lettered. It waits, unacknowledged
///   (Kafka: its offset uncommitted), and runs again when the consumer
///   resumes;
/// - after [`cool_down`](Self::cool_down), one delivery runs as a probe. If
///   its handler runs and commits, the consumer resumes; if it fails, the
///   consumer pauses for another cool-down.
///
/// **No dead letter for an outage.** A dependency that fails every call
/// pauses the consumer after at most [`attempts_to_pause`](Self::attempts_to_pause)
/// failed attempts in a row. The consumer builders refuse a policy whose
/// number is above the retry policy's
/// [`attempts`](crate::RetryPolicy::attempts), so that the consumer pauses
/// before any delivery can exhaust its retries on the outage. Two more
/// rules close the gaps that number leaves:
/// - a held delivery's retries start over when it runs again (its failures
///   were most likely the outage's), so a failure right after a resume
///   does not dead-letter a delivery that was held at its last attempt;
/// - a delivery that runs out of retries while the consumer has counted
///   fewer than `min_attempts` attempts since it started or resumed (a
///   consumer restarted during an outage, a message whose earlier attempts
///   ran on another instance or in a retry queue) is not dead-lettered: it
///   is tried again after the retry policy's last delay, until the
///   consumer can judge, and then pauses or dead-letters it.
///
/// **Long pauses on RabbitMQ.** Deliveries held unacknowledged longer than
/// the broker's `consumer_timeout` (30 minutes by default) make RabbitMQ
/// close the channel; they are redelivered (and deduplicated), and on a
/// quorum queue each redelivery counts towards `x-delivery-limit`. Raise
/// `consumer_timeout` for queues that may pause that long.
///
/// **The trade-off.** A message that fails with a retryable error on its
/// own, while nothing else runs, looks like an outage: the consumer pauses
/// and probes with it until it succeeds. Fail such messages with
/// [`HandlerError::permanent`](crate::HandlerError::permanent): permanent
/// errors are dead-lettered at once and never counted.
///
/// ```
/// use std::time::Duration;
/// use onceonly::PausePolicy;
///
/// // Pause when 5 of the last 10 attempts failed; probe every 15 s.
/// let policy = PausePolicy::new()
///     .window(10)
///     .failure_rate(0.5)
///     .cool_down(Duration::from_secs(15));
/// assert_eq!(policy.attempts_to_pause(), 5);
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PausePolicy {
    window: u32,
    min_attempts: u32,
    failure_rate: f64,
    cool_down: Duration,
}

impl Default for PausePolicy {
    /// A window of 10 attempts, at least 5 of them, a failure rate of 50 %,
    /// a cool-down of 30 s: pauses after 5 failed attempts in a row, within
    /// the default retry policy's 5 attempts.
    fn default() -> Self {
        Self {
            window: 10,
            min_attempts: 5,
            failure_rate: 0.5,
            cool_down: Duration::from_secs(30),
        }
    }
}

impl PausePolicy {
    /// The default policy (see [`Default`](#impl-Default-for-PausePolicy)).
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// How many of the most recent counted attempts the failure rate is
    /// taken over (at least 1; default 10).
    #[must_use]
    pub fn window(mut self, attempts: u32) -> Self {
        self.window = attempts.max(1);
        self
    }

    /// The fewest counted attempts the rate is taken over (default 5): a
    /// consumer that just started does not pause on its first failure.
    /// At most [`window`](Self::window).
    #[must_use]
    pub fn min_attempts(mut self, attempts: u32) -> Self {
        self.min_attempts = attempts.max(1);
        self
    }

    /// The share of failed attempts, above 0 and at most 1, at which the
    /// consumer pauses (default 0.5).
    #[must_use]
    pub fn failure_rate(mut self, rate: f64) -> Self {
        self.failure_rate = rate;
        self
    }

    /// How long the consumer stays paused before it probes (default 30 s).
    #[must_use]
    pub fn cool_down(mut self, cool_down: Duration) -> Self {
        self.cool_down = cool_down;
        self
    }

    /// The number of failed attempts in a row that pause the consumer
    /// whatever came before them: the larger of
    /// [`min_attempts`](Self::min_attempts) and the failures the
    /// [`failure_rate`](Self::failure_rate) needs in a full
    /// [`window`](Self::window).
    #[must_use]
    pub fn attempts_to_pause(&self) -> u32 {
        let window = f64::from(self.window);
        // Rounded up: 0.5 of 9 attempts takes 5 failures. The product is in
        // (0, window], so the cast is exact.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let rate_needs = (self.failure_rate.clamp(0.0, 1.0) * window - 1e-9).ceil() as u32;
        rate_needs.max(self.min_attempts).max(1)
    }

    /// Why this policy cannot be used with `retry`, if it cannot.
    pub(crate) fn check(&self, retry: &RetryPolicy) -> Result<(), String> {
        if !(self.failure_rate > 0.0 && self.failure_rate <= 1.0) {
            return Err(format!(
                "pause_on_failure: failure_rate must be above 0 and at most 1, not {}",
                self.failure_rate
            ));
        }
        if self.min_attempts > self.window {
            return Err(format!(
                "pause_on_failure: min_attempts ({}) must not exceed the window ({})",
                self.min_attempts, self.window
            ));
        }
        if self.window > MAX_WINDOW {
            return Err(format!(
                "pause_on_failure: the window is at most {MAX_WINDOW} attempts, not {}",
                self.window
            ));
        }
        if self.cool_down.is_zero() || self.cool_down > MAX_COOL_DOWN {
            return Err(format!(
                "pause_on_failure: the cool-down must be above zero and at most {MAX_COOL_DOWN:?}, not {:?}",
                self.cool_down
            ));
        }
        let needed = self.attempts_to_pause();
        if needed > retry.attempts() {
            return Err(format!(
                "pause_on_failure pauses after {needed} failed attempts, but the retry policy dead-letters a delivery after {}: an outage would dead-letter messages before the consumer pauses; raise the retry policy's max_attempts or lower the window, min_attempts or failure_rate",
                retry.attempts()
            ));
        }
        Ok(())
    }
}

/// Where the breaker stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Consuming; attempts are counted.
    Running,
    /// Paused until the instant; nothing starts.
    Paused(Instant),
    /// The cool-down is over: one delivery probes (`true` once it started).
    Probing(bool),
}

struct State {
    phase: Phase,
    /// The most recent counted attempts, `true` for a failure.
    recent: VecDeque<bool>,
    failures: u32,
    /// When the current pause began (for the log).
    since: Option<Instant>,
}

/// The breaker of one consumer, shared by its workers: [`admit`](Self::admit)
/// before an attempt, [`held`](Self::held) after it. Without a policy it
/// admits everything and holds nothing.
pub(crate) struct Breaker {
    policy: Option<PausePolicy>,
    state: Mutex<State>,
    changed: Notify,
    telemetry: Telemetry,
    gauge: Gauge,
    pauses_counter: Counter,
    pauses: Arc<AtomicU64>,
}

/// What a worker does after an attempt, the consumer's breaker consulted
/// before [`decide`]: the one place both brokers take it from.
#[derive(Debug)]
pub(crate) enum Step {
    /// The attempt failed while the consumer is (now) paused: admit the
    /// delivery again and run it, its retries started over.
    Held,
    /// Out of retries before the breaker could judge (see
    /// [`Breaker::undecided`]): wait this long, then run it again.
    Again(Duration),
    /// What [`decide`] says.
    Decided(Decision),
}

/// Leave to run one attempt, from [`Breaker::admit`]. A probe that is
/// dropped without a verdict (its consumer stopped) hands the probe on.
pub(crate) struct Pass<'b> {
    probe: Option<&'b Breaker>,
}

impl Pass<'_> {
    /// Whether this attempt probes the dependency after a cool-down (a
    /// Kafka lane then runs it alone, not in a batch).
    #[cfg_attr(not(feature = "kafka"), allow(dead_code))]
    pub(crate) fn is_probe(&self) -> bool {
        self.probe.is_some()
    }
}

impl Drop for Pass<'_> {
    fn drop(&mut self) {
        if let Some(breaker) = self.probe.take() {
            breaker.probe_abandoned();
        }
    }
}

impl Breaker {
    /// The breaker of a consumer recording with `telemetry`; `pauses` counts
    /// its pauses for the consumer's stats.
    pub(crate) fn new(
        policy: Option<PausePolicy>,
        telemetry: &Telemetry,
        pauses: Arc<AtomicU64>,
    ) -> Self {
        let capacity = policy.map_or(0, |p| p.window as usize);
        let gauge = telemetry.paused_gauge();
        // A consumer starts running (a former one of this scope may have
        // stopped while paused).
        if policy.is_some() {
            gauge.set(0.0);
        }
        Self {
            policy,
            state: Mutex::new(State {
                phase: Phase::Running,
                recent: VecDeque::with_capacity(capacity),
                failures: 0,
                since: None,
            }),
            changed: Notify::new(),
            gauge,
            pauses_counter: telemetry.pauses_counter(),
            telemetry: telemetry.clone(),
            pauses,
        }
    }

    /// Whether the consumer is in its cool-down now: a Kafka consumer
    /// pauses fetching meanwhile.
    #[cfg_attr(not(feature = "kafka"), allow(dead_code))]
    pub(crate) fn cooling_down(&self) -> bool {
        self.policy.is_some()
            && matches!(lock(&self.state).phase, Phase::Paused(until) if Instant::now() < until)
    }

    /// Waits until an attempt may start: at once while running; while
    /// paused, until the cool-down is over and this attempt is the probe,
    /// or until the probe resumed consuming. `None` if `stop` was cancelled
    /// first.
    pub(crate) async fn admit(&self, stop: &CancellationToken) -> Option<Pass<'_>> {
        if self.policy.is_none() {
            return Some(Pass { probe: None });
        }
        loop {
            if stop.is_cancelled() {
                return None;
            }
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let until = {
                let mut state = lock(&self.state);
                match state.phase {
                    Phase::Running => return Some(Pass { probe: None }),
                    Phase::Paused(until) if Instant::now() < until => Some(until),
                    Phase::Paused(_) | Phase::Probing(false) => {
                        state.phase = Phase::Probing(true);
                        tracing::info!(
                            scope = self.telemetry.scope(),
                            transport = self.telemetry.transport(),
                            "cool-down over: one delivery probes the handler's dependency"
                        );
                        return Some(Pass { probe: Some(self) });
                    }
                    Phase::Probing(true) => None,
                }
            };
            let until = until.map(tokio::time::Instant::from_std);
            tokio::select! {
                biased;
                () = stop.cancelled() => return None,
                () = &mut changed => {}
                () = async {
                    match until {
                        Some(until) => tokio::time::sleep_until(until).await,
                        None => std::future::pending().await,
                    }
                } => {}
            }
        }
    }

    /// Records the outcome of an attempt run under `pass`; `true` if the
    /// delivery is held: its attempt failed while the consumer is (now)
    /// paused, so it waits for [`admit`](Self::admit) and runs again,
    /// neither counted as an attempt nor dead-lettered.
    fn held<T>(&self, pass: &mut Pass<'_>, outcome: &Outcome<T>) -> bool {
        let Some(policy) = self.policy else {
            return false;
        };
        let verdict = verdict(outcome);
        let mut state = lock(&self.state);
        if pass.probe.take().is_some() {
            match verdict {
                Some(false) => self.resume(&mut state),
                Some(true) => {
                    state.phase = Phase::Paused(Instant::now() + policy.cool_down);
                    tracing::info!(
                        scope = self.telemetry.scope(),
                        transport = self.telemetry.transport(),
                        cool_down = ?policy.cool_down,
                        "the probe failed: consuming stays paused"
                    );
                    self.changed.notify_waiters();
                }
                None => {
                    state.phase = Phase::Probing(false);
                    self.changed.notify_waiters();
                }
            }
            return verdict == Some(true);
        }
        let Some(failed) = verdict else {
            return false;
        };
        if state.phase != Phase::Running {
            // Admitted before the pause: a failure waits with the others, a
            // late success says nothing about now.
            return failed;
        }
        if state.recent.len() >= policy.window as usize && state.recent.pop_front() == Some(true) {
            state.failures -= 1;
        }
        state.recent.push_back(failed);
        if failed {
            state.failures += 1;
        }
        let attempts = u32::try_from(state.recent.len()).unwrap_or(u32::MAX);
        let tripped = failed
            && attempts >= policy.min_attempts
            && f64::from(state.failures) >= policy.failure_rate * f64::from(attempts) - 1e-9;
        if tripped {
            self.pause(&mut state, policy, attempts);
        }
        tripped
    }

    /// Records the outcome of an attempt run under `pass`, made after
    /// `attempts` attempts of the delivery, and says what to do next.
    pub(crate) fn step<T>(
        &self,
        pass: &mut Pass<'_>,
        outcome: &Outcome<T>,
        attempts: u32,
        policy: &RetryPolicy,
    ) -> Step {
        if self.held(pass, outcome) {
            return Step::Held;
        }
        match decide(outcome, attempts, policy) {
            Decision::DeadLetter { .. } if self.undecided(outcome) => {
                Step::Again(policy.final_delay())
            }
            decision => Step::Decided(decision),
        }
    }

    /// Counts the outcome of an attempt that needs no verdict (one
    /// committed in a Kafka batch).
    #[cfg_attr(not(feature = "kafka"), allow(dead_code))]
    pub(crate) fn observe<T>(&self, outcome: &Outcome<T>) {
        self.held(&mut Pass { probe: None }, outcome);
    }

    /// Whether `outcome`, a failure that ran out of retries, must not be
    /// dead-lettered yet: it is one the policy counts, and the breaker has
    /// counted fewer than `min_attempts` attempts since it started or
    /// resumed, too few to tell an outage from this delivery's own failure
    /// (a consumer restarted during an outage, a delivery whose earlier
    /// attempts ran on another instance). It is tried again until the
    /// breaker can judge: then it pauses (and holds it) or it is
    /// dead-lettered.
    fn undecided<T>(&self, outcome: &Outcome<T>) -> bool {
        let Some(policy) = self.policy else {
            return false;
        };
        verdict(outcome) == Some(true) && {
            let state = lock(&self.state);
            state.phase == Phase::Running
                && u32::try_from(state.recent.len()).unwrap_or(u32::MAX) < policy.min_attempts
        }
    }

    fn pause(&self, state: &mut State, policy: PausePolicy, attempts: u32) {
        state.phase = Phase::Paused(Instant::now() + policy.cool_down);
        state.since = Some(Instant::now());
        self.gauge.set(1.0);
        self.pauses_counter.increment(1);
        self.pauses.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(
            scope = self.telemetry.scope(),
            transport = self.telemetry.transport(),
            failed = state.failures,
            of = attempts,
            cool_down = ?policy.cool_down,
            "the handler keeps failing: consuming paused; deliveries in flight wait (not retried, not dead-lettered) until a probe succeeds"
        );
    }

    fn resume(&self, state: &mut State) {
        state.phase = Phase::Running;
        state.recent.clear();
        state.failures = 0;
        let paused_for = state.since.take().map(|s| s.elapsed());
        self.gauge.set(0.0);
        tracing::info!(
            scope = self.telemetry.scope(),
            transport = self.telemetry.transport(),
            ?paused_for,
            "the probe succeeded: consuming resumes"
        );
        self.changed.notify_waiters();
    }

    fn probe_abandoned(&self) {
        let mut state = lock(&self.state);
        if state.phase == Phase::Probing(true) {
            state.phase = Phase::Probing(false);
            self.changed.notify_waiters();
        }
    }
}

/// What an outcome says about the handler's dependency: `Some(true)` a
/// failure, `Some(false)` a success, `None` nothing.
fn verdict<T>(outcome: &Outcome<T>) -> Option<bool> {
    match outcome {
        Outcome::Processed { .. } => Some(false),
        // A handler given up at the transaction deadline, again and again:
        // a dependency that hangs.
        Outcome::Failed(Failure::Deadline { .. }) => Some(true),
        Outcome::Failed(f) if f.infra_fault().is_none() && f.is_retryable() => Some(true),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::KeyRedaction;
    use crate::engine::HandlerError;

    fn breaker(policy: PausePolicy) -> Breaker {
        let telemetry = Telemetry::new("test", "kafka", KeyRedaction::default());
        Breaker::new(Some(policy), &telemetry, Arc::default())
    }

    fn failed() -> Outcome<()> {
        Outcome::Failed(Failure::Handler(HandlerError::retryable("down")))
    }

    fn processed() -> Outcome<()> {
        Outcome::Processed { result: () }
    }

    #[test]
    fn attempts_to_pause_is_the_worst_case_run_of_failures() {
        let p = PausePolicy::new();
        assert_eq!(p.attempts_to_pause(), 5);
        assert_eq!(p.window(9).min_attempts(1).attempts_to_pause(), 5);
        assert_eq!(p.window(20).failure_rate(0.1).attempts_to_pause(), 5);
        assert_eq!(p.window(20).failure_rate(1.0).attempts_to_pause(), 20);
        assert!(p.check(&RetryPolicy::default()).is_ok());
        let err = p
            .check(&RetryPolicy::default().max_attempts(3))
            .unwrap_err();
        assert!(err.contains("after 5 failed attempts"), "{err}");
        assert!(p.failure_rate(0.0).check(&RetryPolicy::default()).is_err());
        assert!(p.min_attempts(11).check(&RetryPolicy::default()).is_err());
        let huge = p
            .cool_down(Duration::from_secs(100 * 24 * 3600))
            .check(&RetryPolicy::default())
            .unwrap_err();
        assert!(huge.contains("at most"), "{huge}");
        let wide = p
            .window(20_000)
            .min_attempts(1)
            .failure_rate(0.0001)
            .check(&RetryPolicy::default())
            .unwrap_err();
        assert!(wide.contains("at most 10000"), "{wide}");
    }

    #[tokio::test]
    async fn pauses_at_the_rate_holds_failures_and_resumes_on_a_probe() {
        let b = breaker(PausePolicy::new().cool_down(Duration::from_millis(300)));
        let stop = CancellationToken::new();
        // 6 successes then failures: the window of 10 needs 5 failures.
        for _ in 0..6 {
            let mut pass = b.admit(&stop).await.unwrap();
            assert!(!b.held(&mut pass, &processed()));
        }
        for _ in 0..4 {
            let mut pass = b.admit(&stop).await.unwrap();
            assert!(!b.held(&mut pass, &failed()), "retried as usual");
        }
        let mut pass = b.admit(&stop).await.unwrap();
        assert!(b.held(&mut pass, &failed()), "the fifth failure pauses");
        assert!(b.cooling_down());
        assert_eq!(b.pauses.load(Ordering::Relaxed), 1);
        // Duplicates and permanent errors are not counted and not held.
        let permanent: Outcome<()> =
            Outcome::Failed(Failure::Handler(HandlerError::permanent("bad")));
        assert!(!b.held(&mut Pass { probe: None }, &permanent));
        // A failure of a delivery admitted before the pause is held.
        assert!(b.held(&mut Pass { probe: None }, &failed()));

        // Nothing starts during the cool-down.
        let waited = tokio::time::timeout(Duration::from_millis(20), b.admit(&stop)).await;
        assert!(waited.is_err());
        // Then one probe; the others wait for it.
        let mut probe = b.admit(&stop).await.unwrap();
        assert!(probe.probe.is_some());
        assert!(
            tokio::time::timeout(Duration::from_millis(80), b.admit(&stop))
                .await
                .is_err()
        );
        // A failed probe pauses again.
        assert!(b.held(&mut probe, &failed()));
        assert!(b.cooling_down());
        let mut probe = b.admit(&stop).await.unwrap();
        let waiter = b.admit(&stop);
        tokio::pin!(waiter);
        assert!(
            tokio::time::timeout(Duration::from_millis(10), &mut waiter)
                .await
                .is_err()
        );
        assert!(!b.held(&mut probe, &processed()));
        let pass = waiter.await.unwrap();
        assert!(pass.probe.is_none(), "running again");
        assert_eq!(b.pauses.load(Ordering::Relaxed), 1);
    }

    #[tokio::test]
    async fn an_abandoned_or_neutral_probe_hands_the_probe_on() {
        let b = breaker(
            PausePolicy::new()
                .window(2)
                .min_attempts(2)
                .failure_rate(1.0)
                .cool_down(Duration::from_millis(10)),
        );
        let stop = CancellationToken::new();
        for held in [false, true] {
            let mut pass = b.admit(&stop).await.unwrap();
            assert_eq!(b.held(&mut pass, &failed()), held);
        }
        let probe = b.admit(&stop).await.unwrap();
        drop(probe);
        let mut probe = b.admit(&stop).await.unwrap();
        assert!(probe.probe.is_some(), "the dropped probe was handed on");
        let duplicate: Outcome<()> = Outcome::Duplicate { result: None };
        assert!(!b.held(&mut probe, &duplicate));
        let probe = b.admit(&stop).await.unwrap();
        assert!(probe.probe.is_some(), "a duplicate told nothing");
        stop.cancel();
        assert!(b.admit(&stop).await.is_none(), "a stop ends the wait");
    }

    #[tokio::test]
    async fn exhausted_failures_wait_until_the_breaker_can_judge() {
        let stop = CancellationToken::new();
        // A fresh breaker (a consumer restarted during an outage): the
        // first failures are not dead-lettered, the fifth pauses.
        let b = breaker(PausePolicy::new());
        for _ in 0..4 {
            let mut pass = b.admit(&stop).await.unwrap();
            assert!(!b.held(&mut pass, &failed()));
            assert!(b.undecided(&failed()), "too few attempts to judge");
        }
        let mut pass = b.admit(&stop).await.unwrap();
        assert!(b.held(&mut pass, &failed()), "paused and held");
        assert!(!b.undecided(&failed()), "held, not retried");
        // A breaker that judged a low failure rate lets it be dead-lettered,
        // and never holds what it does not count.
        let b = breaker(PausePolicy::new());
        for i in 0..10 {
            let outcome = if i == 9 { failed() } else { processed() };
            let mut pass = b.admit(&stop).await.unwrap();
            assert!(!b.held(&mut pass, &outcome));
        }
        assert!(!b.undecided(&failed()));
        let permanent: Outcome<()> =
            Outcome::Failed(Failure::Handler(HandlerError::permanent("bad")));
        assert!(!breaker(PausePolicy::new()).undecided(&permanent));
        // A handler given up at the deadline again and again counts: a
        // dependency that hangs.
        let b = breaker(PausePolicy::new().window(2).min_attempts(2));
        let hung: Outcome<()> = Outcome::Failed(Failure::Deadline { misses: 3 });
        for held in [false, true] {
            let mut pass = b.admit(&stop).await.unwrap();
            assert_eq!(b.held(&mut pass, &hung), held);
        }
    }

    #[tokio::test]
    async fn without_a_policy_everything_runs() {
        let telemetry = Telemetry::new("test", "amqp", KeyRedaction::default());
        let b = Breaker::new(None, &telemetry, Arc::default());
        let stop = CancellationToken::new();
        for _ in 0..20 {
            let mut pass = b.admit(&stop).await.unwrap();
            assert!(!b.held(&mut pass, &failed()));
        }
        assert!(!b.cooling_down());
    }
}
