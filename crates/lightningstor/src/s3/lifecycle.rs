//! Bucket lifecycle: Put/Get/DeleteBucketLifecycle(Configuration) in both
//! modes, the translation between s3s's DTOs and [`crate::lifecycle`]'s
//! rules, the single node's [`Target`] for the background task, and the
//! expiry and abort steps the cluster's target runs too.

use crate::conditions::DeleteConditions;
use crate::engine::Engine;
use crate::error::{LightningError, Result};
use crate::lifecycle::{self, Candidate, Page, PendingUpload, Rule, Scope, Target};
use crate::metrics::Metrics;
use crate::store::Store;
use s3s::S3Request;
use s3s::dto::*;
use std::sync::{Arc, Weak};

fn not_implemented(what: &str) -> LightningError {
    LightningError::NotImplemented(format!("lifecycle rule element {what} is not implemented by this server"))
}

fn days(d: Option<i32>, what: &str) -> Result<u32> {
    match d {
        None => Err(LightningError::MalformedXml(format!("{what} needs a number of days"))),
        Some(d) => u32::try_from(d)
            .map_err(|_| LightningError::InvalidArgument(format!("{what}: days must be a positive integer, not {d}"))),
    }
}

/// A rule of the supported subset, or NotImplemented naming the first
/// element outside it (pure).
fn rule_from(r: &LifecycleRule, index: usize) -> Result<Rule> {
    if r.transitions.as_ref().is_some_and(|t| !t.is_empty()) {
        return Err(not_implemented("Transition"));
    }
    if r.noncurrent_version_expiration.is_some() {
        return Err(not_implemented("NoncurrentVersionExpiration"));
    }
    if r.noncurrent_version_transitions.as_ref().is_some_and(|t| !t.is_empty()) {
        return Err(not_implemented("NoncurrentVersionTransition"));
    }
    let scope = match (&r.filter, &r.prefix) {
        (Some(_), Some(_)) => {
            return Err(LightningError::MalformedXml("a rule may have a Filter or a Prefix, not both".into()));
        }
        (None, Some(p)) => Scope::Legacy(p.clone()),
        (None, None) => return Err(LightningError::MalformedXml("a rule needs a Filter or a Prefix".into())),
        (Some(f), None) => {
            if f.and.is_some() {
                return Err(not_implemented("Filter/And"));
            }
            if f.tag.is_some() {
                return Err(not_implemented("Filter/Tag"));
            }
            if f.object_size_greater_than.is_some() {
                return Err(not_implemented("Filter/ObjectSizeGreaterThan"));
            }
            if f.object_size_less_than.is_some() {
                return Err(not_implemented("Filter/ObjectSizeLessThan"));
            }
            match &f.prefix {
                Some(p) => Scope::Filter(p.clone()),
                None => Scope::All,
            }
        }
    };
    let enabled = match r.status.as_str() {
        ExpirationStatus::ENABLED => true,
        ExpirationStatus::DISABLED => false,
        other => return Err(LightningError::MalformedXml(format!("rule status {other:?} is not Enabled or Disabled"))),
    };
    let expiration_days = match &r.expiration {
        None => None,
        Some(e) => {
            if e.date.is_some() {
                return Err(not_implemented("Expiration/Date"));
            }
            if e.expired_object_delete_marker.is_some() {
                return Err(not_implemented("Expiration/ExpiredObjectDeleteMarker"));
            }
            Some(days(e.days, "Expiration")?)
        }
    };
    let abort_days = match &r.abort_incomplete_multipart_upload {
        None => None,
        Some(a) => Some(days(a.days_after_initiation, "AbortIncompleteMultipartUpload")?),
    };
    // S3 names a rule without an ID itself; a name from its position is
    // stable across GETs and cannot collide with the given ones unless the
    // client chose the same (then the configuration is refused as a duplicate).
    let id = r.id.clone().unwrap_or_else(|| format!("rule-{}", index + 1));
    Ok(Rule { id, enabled, scope, expiration_days, abort_days })
}

/// The rules of a PutBucketLifecycleConfiguration, validated (pure; shared
/// with the cluster).
pub(crate) fn rules_from(input: &PutBucketLifecycleConfigurationInput) -> Result<Vec<Rule>> {
    let Some(cfg) = &input.lifecycle_configuration else {
        return Err(LightningError::MalformedXml("the body holds no LifecycleConfiguration".into()));
    };
    let rules = cfg.rules.iter().enumerate().map(|(i, r)| rule_from(r, i)).collect::<Result<Vec<_>>>()?;
    lifecycle::validate(&rules)?;
    Ok(rules)
}

/// The GetBucketLifecycleConfiguration answer for `rules` (pure; shared
/// with the cluster). No rules: NoSuchLifecycleConfiguration.
pub(crate) fn rules_output(bucket: &str, rules: &[Rule]) -> Result<GetBucketLifecycleConfigurationOutput> {
    if rules.is_empty() {
        return Err(LightningError::NoSuchLifecycleConfiguration(bucket.to_owned()));
    }
    let day = |d: u32| i32::try_from(d).unwrap_or(i32::MAX);
    let rules = rules
        .iter()
        .map(|r| LifecycleRule {
            id: Some(r.id.clone()),
            status: ExpirationStatus::from_static(if r.enabled {
                ExpirationStatus::ENABLED
            } else {
                ExpirationStatus::DISABLED
            }),
            filter: match &r.scope {
                Scope::Filter(p) => Some(LifecycleRuleFilter { prefix: Some(p.clone()), ..Default::default() }),
                Scope::All => Some(LifecycleRuleFilter::default()),
                Scope::Legacy(_) => None,
            },
            prefix: match &r.scope {
                Scope::Legacy(p) => Some(p.clone()),
                _ => None,
            },
            expiration: r.expiration_days.map(|d| LifecycleExpiration { days: Some(day(d)), ..Default::default() }),
            abort_incomplete_multipart_upload: r
                .abort_days
                .map(|d| AbortIncompleteMultipartUpload { days_after_initiation: Some(day(d)) }),
            noncurrent_version_expiration: None,
            noncurrent_version_transitions: None,
            transitions: None,
        })
        .collect();
    Ok(GetBucketLifecycleConfigurationOutput { rules: Some(rules), transition_default_minimum_object_size: None })
}

pub(crate) async fn put_bucket_lifecycle_configuration<E: Engine>(
    e: &E,
    req: S3Request<PutBucketLifecycleConfigurationInput>,
) -> Result<PutBucketLifecycleConfigurationOutput> {
    let rules = rules_from(&req.input)?;
    e.set_lifecycle(&req.input.bucket, rules).await?;
    Ok(PutBucketLifecycleConfigurationOutput::default())
}

pub(crate) async fn get_bucket_lifecycle_configuration<E: Engine>(
    e: &E,
    req: S3Request<GetBucketLifecycleConfigurationInput>,
) -> Result<GetBucketLifecycleConfigurationOutput> {
    let bucket = req.input.bucket;
    rules_output(&bucket, &e.lifecycle(&bucket).await?)
}

pub(crate) async fn delete_bucket_lifecycle<E: Engine>(
    e: &E,
    req: S3Request<DeleteBucketLifecycleInput>,
) -> Result<DeleteBucketLifecycleOutput> {
    e.set_lifecycle(&req.input.bucket, Vec::new()).await?;
    Ok(DeleteBucketLifecycleOutput::default())
}

/// Deletes the expired object `c` through `e` only if the key still holds
/// the object that was listed: false when it changed or went meanwhile.
/// Shared by the single node's and a cluster node's lifecycle [`Target`].
pub(crate) async fn expire<E: Engine>(e: &E, bucket: &str, c: &Candidate) -> Result<bool> {
    expired(e.delete(bucket, &c.key, None, &unchanged(c)).await.map(drop))
}

/// The outcome of a delete of an expired object made under [`unchanged`]:
/// false when the key changed or went meanwhile.
pub(crate) fn expired(r: Result<()>) -> Result<bool> {
    match r {
        Ok(()) => Ok(true),
        Err(LightningError::PreconditionFailed | LightningError::NoSuchKey { .. }) => Ok(false),
        Err(err) => Err(err),
    }
}

/// Aborts the stale upload `u` through `e`: false when it went meanwhile.
pub(crate) async fn abort<E: Engine>(e: &E, bucket: &str, u: &PendingUpload) -> Result<bool> {
    match e.abort_upload(bucket, &u.key, &u.id).await {
        Ok(()) => Ok(true),
        Err(LightningError::NoSuchUpload(_)) => Ok(false),
        Err(err) => Err(err),
    }
}

/// A delete of `c` only if the key still holds the object that was listed.
pub(crate) fn unchanged(c: &Candidate) -> DeleteConditions {
    DeleteConditions {
        if_match: Some(ETagCondition::ETag(ETag::Strong(c.etag.clone()))),
        size: None,
        last_modified: Some(c.last_modified_ms.div_euclid(1000)),
    }
}

/// The single node's lifecycle target: every key of its store.
struct Local(Arc<Store>);

#[async_trait::async_trait]
impl Target for Local {
    async fn prepare(&self) -> Result<()> {
        Ok(())
    }

    async fn configured_buckets(&self) -> Result<Vec<(String, Vec<Rule>)>> {
        let all = self.0.meta.list_buckets()?;
        Ok(all.into_iter().filter(|(_, m)| !m.rules().is_empty()).map(|(n, m)| (n, m.rules().to_vec())).collect())
    }

    async fn objects(&self, bucket: &str, after: &str, limit: usize) -> Result<Page> {
        let store = self.0.clone();
        let (bucket, from) = (bucket.to_owned(), after_key(after));
        let rows = tokio::task::spawn_blocking(move || store.meta.list_raw(&bucket, &from, b"", limit))
            .await
            .map_err(|e| LightningError::Io(std::io::Error::other(e)))??;
        Ok(page_of(rows, limit, |_| true))
    }

    async fn expire(&self, bucket: &str, c: &Candidate) -> Result<bool> {
        expire(&self.0, bucket, c).await
    }

    async fn uploads(&self, bucket: &str, limit: usize) -> Result<Vec<PendingUpload>> {
        let ups = self.0.meta.list_uploads(bucket, "", None, None, limit)?;
        Ok(ups.into_iter().map(|(key, id, u)| PendingUpload { key, id, initiated_ms: u.initiated_ms }).collect())
    }

    async fn abort(&self, bucket: &str, u: &PendingUpload) -> Result<bool> {
        abort(&self.0, bucket, u).await
    }

    fn metrics(&self) -> &Metrics {
        &self.0.metrics
    }
}

/// The smallest key after `after` ("" from the start).
pub(crate) fn after_key(after: &str) -> Vec<u8> {
    let mut from = after.as_bytes().to_vec();
    if !from.is_empty() {
        from.push(0);
    }
    from
}

/// A [`Page`] of raw rows (tombstones skipped), keeping the keys `mine` accepts.
pub(crate) fn page_of(
    rows: Vec<(Vec<u8>, crate::meta::types::RawEntry)>,
    limit: usize,
    mine: impl Fn(&[u8]) -> bool,
) -> Page {
    let scanned = rows.len();
    let last = if scanned < limit { None } else { rows.last().map(|(k, _)| String::from_utf8_lossy(k).into_owned()) };
    let candidates = rows
        .into_iter()
        .filter(|(k, _)| mine(k))
        .filter_map(|(k, e)| {
            let s = e.summary?;
            let key = String::from_utf8(k).ok()?;
            Some(Candidate { key, etag: s.etag, last_modified_ms: s.last_modified_ms })
        })
        .collect();
    Page { candidates, scanned, last }
}

/// Starts the single node's lifecycle task; it ends once `store` is dropped.
pub fn spawn(store: &Arc<Store>) -> tokio::task::JoinHandle<()> {
    let weak: Weak<Store> = Arc::downgrade(store);
    let cfg = &store.config;
    let interval = std::time::Duration::from_secs(cfg.lifecycle_interval_secs);
    let day_ms = i64::try_from(cfg.lifecycle_day_secs.saturating_mul(1000)).unwrap_or(i64::MAX);
    tokio::spawn(lifecycle::run(move || weak.upgrade().map(|s| Arc::new(Local(s))), interval, day_ms))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input(rule: LifecycleRule) -> PutBucketLifecycleConfigurationInput {
        PutBucketLifecycleConfigurationInput {
            bucket: "b".into(),
            lifecycle_configuration: Some(BucketLifecycleConfiguration { rules: vec![rule] }),
            ..Default::default()
        }
    }

    fn base() -> LifecycleRule {
        LifecycleRule {
            abort_incomplete_multipart_upload: None,
            expiration: Some(LifecycleExpiration { days: Some(3), ..Default::default() }),
            filter: Some(LifecycleRuleFilter { prefix: Some("tmp/".into()), ..Default::default() }),
            id: Some("r".into()),
            noncurrent_version_expiration: None,
            noncurrent_version_transitions: None,
            prefix: None,
            status: ExpirationStatus::from_static(ExpirationStatus::ENABLED),
            transitions: None,
        }
    }

    #[test]
    fn supported_rules_come_back_as_they_were_put() {
        let legacy = LifecycleRule {
            filter: None,
            prefix: Some("old/".into()),
            id: Some("l".into()),
            expiration: None,
            abort_incomplete_multipart_upload: Some(AbortIncompleteMultipartUpload { days_after_initiation: Some(1) }),
            status: ExpirationStatus::from_static(ExpirationStatus::DISABLED),
            ..base()
        };
        let all = LifecycleRule { filter: Some(LifecycleRuleFilter::default()), id: Some("a".into()), ..base() };
        for r in [base(), legacy, all] {
            let rules = rules_from(&input(r.clone())).expect("supported");
            let out = rules_output("b", &rules).expect("rules");
            assert_eq!(out.rules, Some(vec![r]));
        }
        assert!(matches!(rules_output("b", &[]), Err(LightningError::NoSuchLifecycleConfiguration(_))));
    }

    #[test]
    fn elements_outside_the_subset_are_not_implemented_and_bad_values_are_refused() {
        let refused = [
            LifecycleRule {
                filter: Some(LifecycleRuleFilter {
                    tag: Some(Tag { key: Some("k".into()), value: Some("v".into()) }),
                    ..Default::default()
                }),
                ..base()
            },
            LifecycleRule {
                filter: Some(LifecycleRuleFilter { object_size_greater_than: Some(5), ..Default::default() }),
                ..base()
            },
            LifecycleRule {
                filter: Some(LifecycleRuleFilter {
                    and: Some(LifecycleRuleAndOperator::default()),
                    ..Default::default()
                }),
                ..base()
            },
            LifecycleRule {
                expiration: Some(LifecycleExpiration {
                    expired_object_delete_marker: Some(true),
                    ..Default::default()
                }),
                ..base()
            },
            LifecycleRule { noncurrent_version_expiration: Some(NoncurrentVersionExpiration::default()), ..base() },
            LifecycleRule { transitions: Some(vec![Transition::default()]), ..base() },
        ];
        for r in refused {
            assert!(matches!(rules_from(&input(r.clone())), Err(LightningError::NotImplemented(_))), "{r:?}");
        }
        let zero =
            LifecycleRule { expiration: Some(LifecycleExpiration { days: Some(0), ..Default::default() }), ..base() };
        assert!(matches!(rules_from(&input(zero)), Err(LightningError::InvalidArgument(_))));
        let neg =
            LifecycleRule { expiration: Some(LifecycleExpiration { days: Some(-1), ..Default::default() }), ..base() };
        assert!(matches!(rules_from(&input(neg)), Err(LightningError::InvalidArgument(_))));
        let none = LifecycleRule { expiration: None, ..base() };
        assert!(matches!(rules_from(&input(none)), Err(LightningError::InvalidRequest(_))));
        let both = LifecycleRule { prefix: Some("x".into()), ..base() };
        assert!(matches!(rules_from(&input(both)), Err(LightningError::MalformedXml(_))));
    }
}
