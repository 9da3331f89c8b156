//! The nemesis: which fault hits which node when, derived from the seed
//! alone ([`plan`], pure, so a run can be replayed), and the task that
//! applies that plan through a [`FaultDriver`] and records each event.
//!
//! Faults come one at a time: a quiet warm-up, then fault, heal, a quiet
//! gap, and so on, with a quiet tail before the end so the cluster has
//! healed when the clients stop.

use super::record::Recorder;
use crate::check::history::{NemesisEvent, NemesisPhase};
use crate::fault::{Fault, FaultDriver, FaultKind};
use std::time::{Duration, Instant};

/// One planned fault, with times from the start of the run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Planned {
    pub fault: Fault,
    pub start: Duration,
    pub heal: Duration,
}

/// Shortest and longest time a fault lasts, and the quiet gap between two.
const FAULT_MS: (u64, u64) = (1_000, 4_000);
const GAP_MS: (u64, u64) = (1_000, 3_000);

fn between(rng: &mut u64, (lo, hi): (u64, u64)) -> u64 {
    lo + crate::loadgen::xorshift(rng) % (hi - lo + 1)
}

/// The faults of a run of `duration` on `service` at `nodes`, from `seed`.
/// Empty without kinds or nodes.
pub fn plan(seed: u64, kinds: &[FaultKind], service: &str, nodes: &[String], duration: Duration) -> Vec<Planned> {
    let mut out = Vec::new();
    if kinds.is_empty() || nodes.is_empty() {
        return out;
    }
    let mut rng = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0xd1b5_4a32_d192_ed03;
    rng |= 1;
    let total = duration.as_millis() as u64;
    let warmup = (total / 10).min(2_000);
    let end = total.saturating_sub((total / 8).min(3_000));
    let mut t = warmup;
    // At most one fault per second of run: the loop is bounded by the count.
    for _ in 0..=total / 1_000 {
        let len = between(&mut rng, FAULT_MS);
        if t + len > end {
            break;
        }
        let kind = kinds[(crate::loadgen::xorshift(&mut rng) % kinds.len() as u64) as usize];
        let node = &nodes[(crate::loadgen::xorshift(&mut rng) % nodes.len() as u64) as usize];
        let Ok(fault) = Fault::new(kind, service, node) else { break };
        out.push(Planned { fault, start: Duration::from_millis(t), heal: Duration::from_millis(t + len) });
        t += len + between(&mut rng, GAP_MS);
    }
    out
}

/// Longest a driver may take to apply or heal one fault (a kill's heal
/// restarts the node, which waits for it to listen).
const DRIVER_TIMEOUT: Duration = Duration::from_secs(30);

/// Applies `plan` from `t0`, recording each start and heal; returns how
/// many faults were applied. Every fault is healed (healing what is not
/// faulted is a no-op), with a few attempts.
pub async fn apply(plan: &[Planned], driver: &dyn FaultDriver, rec: &Recorder, t0: Instant) -> usize {
    let mut applied = 0;
    for p in plan {
        tokio::time::sleep_until((t0 + p.start).into()).await;
        let started = tokio::time::timeout(DRIVER_TIMEOUT, driver.inject(&p.fault)).await;
        let error = outcome_error(started);
        let ok = error.is_none();
        rec.nemesis(NemesisEvent { time: rec.now(), fault: p.fault.to_string(), phase: NemesisPhase::Start, error });
        if ok {
            applied += 1;
        }
        tokio::time::sleep_until((t0 + p.heal).into()).await;
        let error = heal(driver, &p.fault).await;
        rec.nemesis(NemesisEvent { time: rec.now(), fault: p.fault.to_string(), phase: NemesisPhase::Heal, error });
    }
    applied
}

/// Attempts at healing one fault (a restart that did not come up in time
/// on a loaded host is tried again).
const HEAL_ATTEMPTS: usize = 3;

/// Heals `f`, trying again a few times; the errors of every attempt when
/// none succeeded.
async fn heal(driver: &dyn FaultDriver, f: &crate::fault::Fault) -> Option<String> {
    let mut errors = Vec::new();
    for attempt in 0..HEAL_ATTEMPTS {
        match outcome_error(tokio::time::timeout(DRIVER_TIMEOUT, driver.heal(f)).await) {
            None => return None,
            Some(e) => errors.push(format!("attempt {}: {e}", attempt + 1)),
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    Some(errors.join("; "))
}

fn outcome_error(r: Result<anyhow::Result<()>, tokio::time::error::Elapsed>) -> Option<String> {
    match r {
        Ok(Ok(())) => None,
        Ok(Err(e)) => Some(format!("{e:#}")),
        Err(_) => Some(format!("no answer within {} s", DRIVER_TIMEOUT.as_secs())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn nodes() -> Vec<String> {
        vec!["n1".into(), "n2".into(), "n3".into()]
    }

    #[test]
    fn the_same_seed_gives_the_same_plan_and_another_seed_another() {
        let kinds = [FaultKind::Kill, FaultKind::Pause];
        let d = Duration::from_secs(60);
        assert_eq!(plan(7, &kinds, "lightningstor", &nodes(), d), plan(7, &kinds, "lightningstor", &nodes(), d));
        assert_ne!(plan(7, &kinds, "lightningstor", &nodes(), d), plan(8, &kinds, "lightningstor", &nodes(), d));
    }

    #[test]
    fn no_kinds_or_no_nodes_is_no_fault() {
        assert!(plan(1, &[], "s", &nodes(), Duration::from_secs(60)).is_empty());
        assert!(plan(1, &[FaultKind::Kill], "s", &[], Duration::from_secs(60)).is_empty());
    }

    proptest! {
        #[test]
        fn faults_come_one_at_a_time_and_heal_before_the_end(seed in any::<u64>(), secs in 1u64..300) {
            let d = Duration::from_secs(secs);
            let p = plan(seed, &[FaultKind::Kill, FaultKind::Pause], "lightningstor", &nodes(), d);
            for w in p.windows(2) {
                prop_assert!(w[0].heal < w[1].start);
            }
            for f in &p {
                prop_assert!(f.start < f.heal && f.heal < d);
                prop_assert!(nodes().contains(&f.fault.node));
            }
            if secs >= 20 {
                prop_assert!(!p.is_empty());
            }
        }
    }
}
