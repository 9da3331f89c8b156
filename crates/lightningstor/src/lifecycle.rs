//! Bucket lifecycle: the subset of S3's rules this server applies, their
//! evaluation (pure), and one round of the background task that applies
//! them through a small [`Target`] trait (a single node and a cluster node
//! each implement it; the round is the same for both).
//!
//! Supported: rules with an `ID`, `Status` Enabled/Disabled, a prefix (in
//! `Filter`, the legacy top-level `Prefix`, or an empty filter: every key),
//! `Expiration { Days }` and `AbortIncompleteMultipartUpload {
//! DaysAfterInitiation }`. Everything else is refused when the
//! configuration is put (`s3::lifecycle`), never stored and ignored.
//!
//! A "day" is `day_ms` long: 86 400 000 in production, configurable
//! (`lifecycle_day_secs`) so tests can age objects in seconds. An object
//! expires once `now - last_modified >= days * day` (S3 rounds up to the
//! next midnight UTC; this server does not, so it may expire an object up
//! to a day earlier than S3 would).

use crate::error::{LightningError, Result};
use crate::metrics::Metrics;
use serde::{Deserialize, Serialize};

/// Most rules a configuration may hold (as S3).
pub const MAX_RULES: usize = 1000;

/// A bucket's lifecycle configuration, versioned so replicas keep the
/// newest. No rules means none (a deleted configuration stays as an empty
/// one, so a replica that missed the delete cannot bring the rules back).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lifecycle {
    /// Row version (the metadata counter on a single node, the HLC in a cluster).
    pub version: u64,
    /// The rules, in the order they were given.
    pub rules: Vec<Rule>,
}

/// Which keys a rule applies to, and how the request said so (kept so a
/// GET answers in the form that was put).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Scope {
    /// `<Filter><Prefix>p</Prefix></Filter>`.
    Filter(String),
    /// `<Filter></Filter>`: every key.
    All,
    /// The legacy `<Prefix>p</Prefix>` beside the rule's other elements.
    Legacy(String),
}

impl Scope {
    /// The key prefix the rule applies to ("" for every key).
    pub fn prefix(&self) -> &str {
        match self {
            Scope::Filter(p) | Scope::Legacy(p) => p,
            Scope::All => "",
        }
    }
}

/// One rule.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rule {
    /// The rule's ID (unique within the configuration).
    pub id: String,
    /// `Status` is `Enabled`.
    pub enabled: bool,
    /// The keys it applies to.
    pub scope: Scope,
    /// `Expiration { Days }`: delete objects this many days old.
    pub expiration_days: Option<u32>,
    /// `AbortIncompleteMultipartUpload { DaysAfterInitiation }`.
    pub abort_days: Option<u32>,
}

impl Rule {
    fn applies(&self, key: &str) -> bool {
        self.enabled && key.starts_with(self.scope.prefix())
    }
}

/// Whether `days` days of `day_ms` each have passed in `age_ms`.
fn older_than(age_ms: i64, days: u32, day_ms: i64) -> bool {
    age_ms >= i64::from(days).saturating_mul(day_ms)
}

/// The first enabled rule that expires object `key`, `age_ms` old (pure).
pub fn expiring_rule<'a>(rules: &'a [Rule], key: &str, age_ms: i64, day_ms: i64) -> Option<&'a Rule> {
    rules.iter().find(|r| r.applies(key) && r.expiration_days.is_some_and(|d| older_than(age_ms, d, day_ms)))
}

/// The first enabled rule that aborts a multipart upload of `key` initiated
/// `age_ms` ago (pure).
pub fn aborting_rule<'a>(rules: &'a [Rule], key: &str, age_ms: i64, day_ms: i64) -> Option<&'a Rule> {
    rules.iter().find(|r| r.applies(key) && r.abort_days.is_some_and(|d| older_than(age_ms, d, day_ms)))
}

/// Checks the rules S3 puts on a configuration: 1..=1000 rules, unique IDs
/// of at most 255 characters, at least one action per rule, days >= 1.
pub fn validate(rules: &[Rule]) -> Result<()> {
    if rules.is_empty() {
        return Err(LightningError::MalformedXml("a lifecycle configuration needs at least one rule".into()));
    }
    if rules.len() > MAX_RULES {
        return Err(LightningError::MalformedXml(format!(
            "{} lifecycle rules, more than the {MAX_RULES} allowed",
            rules.len()
        )));
    }
    let mut ids = std::collections::HashSet::new();
    for r in rules {
        if r.id.len() > 255 {
            return Err(LightningError::InvalidArgument("a rule ID is longer than 255 characters".into()));
        }
        if !ids.insert(r.id.as_str()) {
            return Err(LightningError::InvalidArgument(format!("rule ID {:?} is used more than once", r.id)));
        }
        if r.expiration_days.is_none() && r.abort_days.is_none() {
            return Err(LightningError::InvalidRequest(format!(
                "rule {:?} has no action (Expiration or AbortIncompleteMultipartUpload)",
                r.id
            )));
        }
        if r.expiration_days == Some(0) || r.abort_days == Some(0) {
            return Err(LightningError::InvalidArgument(format!("rule {:?}: days must be a positive integer", r.id)));
        }
    }
    Ok(())
}

/// An object the task may expire, as its node sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    /// The key.
    pub key: String,
    /// Its ETag (unquoted): the delete is conditional on it, so an object
    /// written again since it was listed is not deleted.
    pub etag: String,
    /// Its last modification, Unix milliseconds.
    pub last_modified_ms: i64,
}

/// A multipart upload the task may abort.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingUpload {
    /// The destination key.
    pub key: String,
    /// The upload id.
    pub id: String,
    /// When it was created, Unix milliseconds.
    pub initiated_ms: i64,
}

/// What the background task acts on: a single node's store, or the keys a
/// cluster node is responsible for (each key handled by one node).
#[async_trait::async_trait]
pub trait Target: Send + Sync {
    /// Called at the start of every round (a cluster node learns which nodes are up).
    async fn prepare(&self) -> Result<()>;
    /// The buckets with a lifecycle configuration, by name, with their rules.
    async fn configured_buckets(&self) -> Result<Vec<(String, Vec<Rule>)>>;
    /// The next at most `limit` objects of `bucket` with keys after `after`,
    /// in key order (a cluster node returns only the keys it handles, but
    /// counts every row it looked at).
    async fn objects(&self, bucket: &str, after: &str, limit: usize) -> Result<Page>;
    /// Deletes `c` through the normal delete path, if it still is as seen.
    /// `Ok(false)`: it changed or went meanwhile, nothing was deleted.
    async fn expire(&self, bucket: &str, c: &Candidate) -> Result<bool>;
    /// Up to `limit` multipart uploads in progress in `bucket`.
    async fn uploads(&self, bucket: &str, limit: usize) -> Result<Vec<PendingUpload>>;
    /// Aborts an upload as AbortMultipartUpload does (its parts' blocks are
    /// freed). `Ok(false)`: it was already gone.
    async fn abort(&self, bucket: &str, u: &PendingUpload) -> Result<bool>;
    /// The node's counters.
    fn metrics(&self) -> &Metrics;
}

/// One page of [`Target::objects`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Page {
    /// The objects to evaluate.
    pub candidates: Vec<Candidate>,
    /// Rows looked at (at least the candidates).
    pub scanned: usize,
    /// The last key looked at; `None` at the end of the bucket.
    pub last: Option<String>,
}

/// Where the next round resumes: a bucket and the last key examined in it.
pub type Resume = Option<(String, String)>;

/// Objects listed per call of [`Target::objects`].
const PAGE: usize = 500;

/// What one round did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct RoundStats {
    /// Objects and uploads looked at.
    pub examined: u64,
    /// Objects deleted.
    pub expired: u64,
    /// Uploads aborted.
    pub aborted: u64,
    /// Deletes or aborts that failed (retried next round).
    pub failed: u64,
}

/// One round: applies every configured bucket's rules, looking at no more
/// than `cap` objects and uploads; `resume` carries the position from one
/// round to the next, so a large store is covered over several rounds.
pub async fn round(t: &dyn Target, now_ms: i64, day_ms: i64, cap: usize, resume: &mut Resume) -> Result<RoundStats> {
    let mut st = RoundStats::default();
    t.prepare().await?;
    let buckets = t.configured_buckets().await?;
    let start = resume.take();
    let mut budget = cap;
    for (bucket, rules) in buckets {
        let mut after = String::new();
        if let Some((b, k)) = &start {
            if bucket < *b {
                continue;
            }
            if bucket == *b {
                after.clone_from(k);
            }
        }
        let active: Vec<Rule> = rules.into_iter().filter(|r| r.enabled).collect();
        if active.is_empty() {
            continue;
        }
        // Uploads once per pass over the bucket, when it is entered from its start.
        if after.is_empty() && active.iter().any(|r| r.abort_days.is_some()) {
            let uploads = t.uploads(&bucket, budget).await?;
            budget = budget.saturating_sub(uploads.len());
            st.examined += uploads.len() as u64;
            for u in uploads {
                if aborting_rule(&active, &u.key, now_ms - u.initiated_ms, day_ms).is_none() {
                    continue;
                }
                match t.abort(&bucket, &u).await {
                    Ok(true) => {
                        st.aborted += 1;
                        tracing::info!(%bucket, key = %u.key, upload = %u.id, "lifecycle aborted an incomplete upload");
                    }
                    Ok(false) => {}
                    Err(e) => {
                        st.failed += 1;
                        tracing::warn!(%bucket, key = %u.key, upload = %u.id, error = %e, "lifecycle abort failed");
                    }
                }
            }
        }
        if !active.iter().any(|r| r.expiration_days.is_some()) {
            continue;
        }
        loop {
            if budget == 0 {
                *resume = Some((bucket, after));
                return Ok(finish(t, st));
            }
            let page = t.objects(&bucket, &after, budget.min(PAGE)).await?;
            budget = budget.saturating_sub(page.scanned.max(1));
            st.examined += page.scanned as u64;
            for c in &page.candidates {
                if expiring_rule(&active, &c.key, now_ms - c.last_modified_ms, day_ms).is_none() {
                    continue;
                }
                match t.expire(&bucket, c).await {
                    Ok(true) => {
                        st.expired += 1;
                        tracing::info!(%bucket, key = %c.key, "lifecycle expired an object");
                    }
                    Ok(false) => {}
                    Err(e) => {
                        st.failed += 1;
                        tracing::warn!(%bucket, key = %c.key, error = %e, "lifecycle expiration failed");
                    }
                }
            }
            match page.last {
                Some(k) => after = k,
                None => break,
            }
        }
    }
    Ok(finish(t, st))
}

fn finish(t: &dyn Target, st: RoundStats) -> RoundStats {
    let m = t.metrics();
    m.inc(&m.lifecycle_rounds);
    m.add(&m.lifecycle_examined, st.examined);
    m.add(&m.lifecycle_expired, st.expired);
    m.add(&m.lifecycle_aborted, st.aborted);
    m.add(&m.lifecycle_failed, st.failed);
    tracing::debug!(examined = st.examined, expired = st.expired, aborted = st.aborted, "lifecycle round done");
    st
}

/// Most objects and uploads one round looks at.
pub const ROUND_CAP: usize = 10_000;

/// Runs [`round`] every `interval` until `target` returns `None` (the
/// node or store is gone).
pub async fn run<T: Target>(
    target: impl Fn() -> Option<std::sync::Arc<T>>,
    interval: std::time::Duration,
    day_ms: i64,
) {
    let mut resume: Resume = None;
    loop {
        tokio::time::sleep(interval).await;
        let Some(t) = target() else { return };
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        let now_ms = i64::try_from(now.as_millis()).unwrap_or(i64::MAX);
        if let Err(e) = round(&*t, now_ms, day_ms, ROUND_CAP, &mut resume).await {
            tracing::warn!(error = %e, "lifecycle round failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn rule(id: &str, prefix: &str, exp: Option<u32>, abort: Option<u32>) -> Rule {
        Rule {
            id: id.into(),
            enabled: true,
            scope: Scope::Filter(prefix.into()),
            expiration_days: exp,
            abort_days: abort,
        }
    }

    #[test]
    fn objects_expire_by_prefix_and_age_and_disabled_rules_do_nothing() {
        let day = 1000;
        let rules = vec![rule("tmp", "tmp/", Some(2), None), rule("all-uploads", "", None, Some(1))];
        assert_eq!(expiring_rule(&rules, "tmp/a", 2000, day).map(|r| r.id.as_str()), Some("tmp"));
        assert!(expiring_rule(&rules, "tmp/a", 1999, day).is_none());
        assert!(expiring_rule(&rules, "keep/a", 1_000_000, day).is_none());
        assert_eq!(aborting_rule(&rules, "keep/a", 1000, day).map(|r| r.id.as_str()), Some("all-uploads"));
        assert!(aborting_rule(&rules, "keep/a", 999, day).is_none());
        let off = vec![Rule { enabled: false, ..rule("tmp", "tmp/", Some(1), Some(1)) }];
        assert!(expiring_rule(&off, "tmp/a", i64::MAX, day).is_none());
        assert!(aborting_rule(&off, "tmp/a", i64::MAX, day).is_none());
    }

    #[test]
    fn configurations_s3_refuses_are_refused() {
        assert!(matches!(validate(&[]), Err(LightningError::MalformedXml(_))));
        let dup = [rule("a", "", Some(1), None), rule("a", "x", Some(1), None)];
        assert!(matches!(validate(&dup), Err(LightningError::InvalidArgument(_))));
        assert!(matches!(validate(&[rule("a", "", None, None)]), Err(LightningError::InvalidRequest(_))));
        assert!(matches!(validate(&[rule("a", "", Some(0), None)]), Err(LightningError::InvalidArgument(_))));
        assert!(matches!(validate(&[rule("a", "", None, Some(0))]), Err(LightningError::InvalidArgument(_))));
        let many: Vec<Rule> = (0..=MAX_RULES).map(|i| rule(&i.to_string(), "", Some(1), None)).collect();
        assert!(matches!(validate(&many), Err(LightningError::MalformedXml(_))));
        assert!(validate(&many[..MAX_RULES]).is_ok());
    }

    fn arb_rule() -> impl Strategy<Value = Rule> {
        (
            any::<bool>(),
            prop_oneof![Just(""), Just("a"), Just("a/"), Just("b")],
            proptest::option::of(1u32..5),
            proptest::option::of(1u32..5),
        )
            .prop_map(|(enabled, p, exp, abort)| Rule {
                id: String::new(),
                enabled,
                scope: Scope::Filter(p.into()),
                expiration_days: exp,
                abort_days: abort,
            })
    }

    /// A store of `n` objects `k000`.. all old, in one bucket whose rule
    /// expires every key: the task's rounds, `cap` objects each, delete
    /// every object exactly once and resume where they stopped.
    struct Fake {
        objects: std::sync::Mutex<std::collections::BTreeMap<String, i64>>,
        deletes: std::sync::Mutex<Vec<String>>,
        metrics: Metrics,
    }

    #[async_trait::async_trait]
    impl Target for Fake {
        async fn prepare(&self) -> Result<()> {
            Ok(())
        }
        async fn configured_buckets(&self) -> Result<Vec<(String, Vec<Rule>)>> {
            Ok(vec![("b".into(), vec![rule("all", "k", Some(1), None)])])
        }
        async fn objects(&self, _bucket: &str, after: &str, limit: usize) -> Result<Page> {
            let objects = self.objects.lock().expect("lock");
            let rows: Vec<(String, i64)> = objects
                .range::<str, _>((std::ops::Bound::Excluded(after), std::ops::Bound::Unbounded))
                .take(limit)
                .map(|(k, v)| (k.clone(), *v))
                .collect();
            let last = if rows.len() < limit { None } else { rows.last().map(|(k, _)| k.clone()) };
            let candidates = rows
                .iter()
                .map(|(k, t)| Candidate { key: k.clone(), etag: String::new(), last_modified_ms: *t })
                .collect();
            Ok(Page { candidates, scanned: rows.len(), last })
        }
        async fn expire(&self, _bucket: &str, c: &Candidate) -> Result<bool> {
            self.deletes.lock().expect("lock").push(c.key.clone());
            Ok(self.objects.lock().expect("lock").remove(&c.key).is_some())
        }
        async fn uploads(&self, _bucket: &str, _limit: usize) -> Result<Vec<PendingUpload>> {
            Ok(Vec::new())
        }
        async fn abort(&self, _bucket: &str, _u: &PendingUpload) -> Result<bool> {
            Ok(false)
        }
        fn metrics(&self) -> &Metrics {
            &self.metrics
        }
    }

    #[test]
    fn bounded_rounds_resume_and_cover_every_object_once() {
        let rt = tokio::runtime::Builder::new_current_thread().build().expect("runtime");
        let fake = Fake {
            objects: std::sync::Mutex::new((0..25).map(|i| (format!("k{i:03}"), 0)).collect()),
            deletes: std::sync::Mutex::new(Vec::new()),
            metrics: Metrics::default(),
        };
        let mut resume = None;
        let mut rounds = 0;
        while !fake.objects.lock().expect("lock").is_empty() {
            let st = rt.block_on(round(&fake, 10_000, 1000, 10, &mut resume)).expect("round");
            assert!(st.examined <= 10, "a round looked at {} objects", st.examined);
            rounds += 1;
            assert!(rounds <= 3, "25 objects at 10 a round take 3 rounds");
        }
        let deletes = fake.deletes.lock().expect("lock").clone();
        let want: Vec<String> = (0..25).map(|i| format!("k{i:03}")).collect();
        assert_eq!(deletes, want, "every object deleted once, in key order");
        assert_eq!(fake.metrics.lifecycle_expired.load(std::sync::atomic::Ordering::Relaxed), 25);
        assert_eq!(fake.metrics.lifecycle_rounds.load(std::sync::atomic::Ordering::Relaxed), 3);
    }

    proptest! {
        /// An object expires exactly when some enabled rule with an
        /// expiration covers its key and its age, and never gets younger
        /// and expired: aging never un-expires it.
        #[test]
        fn expiration_matches_a_plain_model(
            rules in proptest::collection::vec(arb_rule(), 0..5),
            key in prop_oneof![Just("a"), Just("a/x"), Just("ab"), Just("b/c"), Just("c")],
            age in 0i64..6000,
            more in 0i64..6000,
        ) {
            let day = 1000;
            let model = rules.iter().any(|r| {
                r.enabled && key.starts_with(r.scope.prefix())
                    && r.expiration_days.is_some_and(|d| age >= i64::from(d) * day)
            });
            prop_assert_eq!(expiring_rule(&rules, key, age, day).is_some(), model);
            if model {
                prop_assert!(expiring_rule(&rules, key, age + more, day).is_some());
            }
            let upload_model = rules.iter().any(|r| {
                r.enabled && key.starts_with(r.scope.prefix())
                    && r.abort_days.is_some_and(|d| age >= i64::from(d) * day)
            });
            prop_assert_eq!(aborting_rule(&rules, key, age, day).is_some(), upload_model);
        }

        /// Configurations survive the row encoding.
        #[test]
        fn configurations_round_trip_through_postcard(rules in proptest::collection::vec(arb_rule(), 0..5), v: u64) {
            let lc = Lifecycle { version: v, rules };
            let back: Lifecycle = postcard::from_bytes(&postcard::to_allocvec(&lc).expect("encode")).expect("decode");
            prop_assert_eq!(back, lc);
        }
    }
}
