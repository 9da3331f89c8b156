//! The local engine: one node's [`Store`]. Every change is one metadata
//! transaction, write conditions are checked inside it, and blocks stay
//! pinned from their write until the row that references them commits.

use super::{Engine, Staged};
use crate::checksum::ChecksumAlgo;
use crate::conditions::DeleteConditions;
use crate::config::Config;
use crate::error::{LightningError, Result};
use crate::keys::Keyring;
use crate::lifecycle::{Lifecycle, Rule};
use crate::listing::{ListPage, ListQuery};
use crate::meta::now_ms;
use crate::meta::ops::{self, Claimed, CompletedPart, Removed, WriteConditions};
use crate::meta::types::{ObjectData, ObjectMeta, ObjectSummary, PartMeta, UploadMeta, Version, Versioning};
use crate::metrics::Metrics;
use crate::store::{Pins, Store};
use crate::versioning::{VersionPage, VersionQuery, VersionRef};
use bytes::Bytes;
use futures::Stream;
use futures::stream::BoxStream;
use std::ops::Range;
use std::sync::Arc;

/// Runs a blocking read of the store off the async threads.
async fn blocking<T: Send + 'static>(
    store: &Arc<Store>,
    f: impl FnOnce(&Store) -> Result<T> + Send + 'static,
) -> Result<T> {
    let store = store.clone();
    tokio::task::spawn_blocking(move || f(&store)).await.map_err(|e| LightningError::Io(std::io::Error::other(e)))?
}

/// Upload `id` if it belongs to (bucket, key), else NoSuchUpload.
fn upload_of(store: &Store, id: &str, bucket: &str, key: &str) -> Result<UploadMeta> {
    store
        .meta
        .get_upload(id)?
        .filter(|u| u.bucket == bucket && u.key == key)
        .ok_or_else(|| LightningError::NoSuchUpload(id.to_owned()))
}

impl Engine for Arc<Store> {
    type Hold = Pins;
    type Source = ();

    fn config(&self) -> &Config {
        &self.config
    }

    fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    fn keyring(&self) -> &dyn Keyring {
        &**self
    }

    async fn create_bucket(&self, name: &str) -> Result<()> {
        let n = name.to_owned();
        self.meta.write(move |t| ops::create_bucket(t, &n, now_ms())).await
    }

    async fn require_bucket(&self, name: &str) -> Result<()> {
        match self.meta.get_bucket(name)? {
            Some(_) => Ok(()),
            None => Err(LightningError::NoSuchBucket(name.to_owned())),
        }
    }

    async fn delete_bucket(&self, name: &str) -> Result<()> {
        let n = name.to_owned();
        let freed = self.meta.write(move |t| ops::delete_bucket(t, &n)).await?;
        self.spawn_delete(freed);
        Ok(())
    }

    async fn list_buckets(&self) -> Result<Vec<(String, i64)>> {
        Ok(self.meta.list_buckets()?.into_iter().map(|(name, meta)| (name, meta.created_ms)).collect())
    }

    async fn lifecycle(&self, bucket: &str) -> Result<Vec<Rule>> {
        let row = self.meta.get_bucket(bucket)?.ok_or_else(|| LightningError::NoSuchBucket(bucket.to_owned()))?;
        Ok(row.rules().to_vec())
    }

    async fn set_lifecycle(&self, bucket: &str, rules: Vec<Rule>) -> Result<()> {
        // No rules are kept as an empty configuration with a new version (see `Lifecycle`).
        let lc = Lifecycle { version: self.meta.next_version(), rules };
        let b = bucket.to_owned();
        self.meta.write(move |t| ops::set_lifecycle(t, &b, &lc, false)).await?;
        Ok(())
    }

    async fn get(&self, bucket: &str, key: &str) -> Result<Option<(ObjectMeta, ())>> {
        Ok(self.meta.get_object(bucket, key)?.map(|m| (m, ())))
    }

    fn read(&self, meta: &ObjectMeta, (): (), range: Range<u64>) -> BoxStream<'static, Result<Bytes>> {
        Store::read(self, meta, range)
    }

    async fn stage<S, E>(
        &self,
        _bucket: &str,
        _key: &str,
        body: S,
        algo: Option<ChecksumAlgo>,
        inline: bool,
    ) -> Result<Staged<Pins>>
    where
        S: Stream<Item = std::result::Result<Bytes, E>> + Send,
        E: std::fmt::Display + Send,
    {
        let ing = self.ingest(body, algo, inline).await?;
        Ok(Staged { size: ing.size, md5: ing.md5, checksum: ing.checksum, data: ing.data, hold: ing.pins })
    }

    async fn copy_data(&self, _bucket: &str, _key: &str, src: &ObjectMeta, (): ()) -> Result<(ObjectData, Pins)> {
        // The copy shares the source's blocks. Pin them, then make sure
        // they still exist: from here on no concurrent delete can remove
        // them before the copy commits.
        let pins = self.pin_existing(src.data.blocks())?;
        Ok((src.data.clone(), pins))
    }

    async fn commit(
        &self,
        bucket: &str,
        key: &str,
        row: ObjectMeta,
        hold: Pins,
        cond: &WriteConditions,
    ) -> Result<ObjectMeta> {
        let row = ObjectMeta { version: self.meta.next_version(), ..row };
        let (b, k, c) = (bucket.to_owned(), key.to_owned(), cond.clone());
        let (row, freed) = self.meta.write(move |t| ops::write_object(t, &b, &k, row, &c)).await?;
        hold.release();
        self.spawn_delete(freed);
        Ok(row)
    }

    async fn delete(
        &self,
        bucket: &str,
        key: &str,
        version: Option<VersionRef>,
        cond: &DeleteConditions,
    ) -> Result<Removed> {
        let (b, k, c) = (bucket.to_owned(), key.to_owned(), cond.clone());
        let v = self.meta.next_version();
        let (removed, freed) = self.meta.write(move |t| ops::delete_any(t, &b, &k, version, &c, v)).await?;
        self.spawn_delete(freed);
        Ok(removed)
    }

    async fn delete_many(
        &self,
        bucket: &str,
        keys: Vec<(String, Option<VersionRef>, DeleteConditions)>,
    ) -> Result<Vec<Result<Removed>>> {
        let bucket = bucket.to_owned();
        let versions: Vec<u64> = keys.iter().map(|_| self.meta.next_version()).collect();
        // One transaction for the whole batch.
        let (results, freed) = self
            .meta
            .write(move |t| {
                let mut out = Vec::with_capacity(keys.len());
                let mut freed = Vec::new();
                for ((key, v, cond), version) in keys.into_iter().zip(versions) {
                    match ops::delete_any(t, &bucket, &key, v, &cond, version) {
                        Ok((r, f)) => {
                            freed.extend(f);
                            out.push(Ok(r));
                        }
                        Err(e @ (LightningError::Db(_) | LightningError::Io(_))) => return Err(e),
                        Err(e) => out.push(Err(e)),
                    }
                }
                Ok((out, freed))
            })
            .await?;
        self.spawn_delete(freed);
        Ok(results)
    }

    async fn versioning(&self, bucket: &str) -> Result<Option<Versioning>> {
        let row = self.meta.get_bucket(bucket)?.ok_or_else(|| LightningError::NoSuchBucket(bucket.to_owned()))?;
        Ok(row.versioning)
    }

    async fn set_versioning(&self, bucket: &str, state: Versioning) -> Result<()> {
        let b = bucket.to_owned();
        self.meta.write(move |t| crate::meta::versions::set_versioning(t, &b, state)).await
    }

    async fn get_version(&self, bucket: &str, key: &str, version: VersionRef) -> Result<(ObjectMeta, ())> {
        let missing = |id: String| LightningError::NoSuchVersion { key: key.to_owned(), version_id: id };
        match self.meta.get_version(bucket, key, version)? {
            Some(Version::Object(m)) => Ok((m, ())),
            Some(v @ Version::Marker(_)) => {
                Err(LightningError::DeleteMarker { key: key.to_owned(), version_id: v.id(), named: true })
            }
            // Outside versioned buckets the current object is the null version.
            None => match (version, self.meta.get_object(bucket, key)?) {
                (VersionRef::Null, Some(m)) if m.versioned.is_none() => Ok((m, ())),
                _ => {
                    self.require_bucket(bucket).await?;
                    Err(missing(match version {
                        VersionRef::Null => "null".into(),
                        VersionRef::Id(id) => crate::versioning::version_id(id, false),
                    }))
                }
            },
        }
    }

    async fn latest_marker(&self, bucket: &str, key: &str) -> Result<Option<String>> {
        Ok(match self.meta.latest_version(bucket, key)? {
            Some(v @ Version::Marker(_)) => Some(v.id()),
            _ => None,
        })
    }

    async fn list_versions(&self, bucket: &str, q: VersionQuery) -> Result<VersionPage> {
        let bucket = bucket.to_owned();
        blocking(self, move |s| {
            if s.meta.get_bucket(&bucket)?.is_none() {
                return Err(LightningError::NoSuchBucket(bucket));
            }
            s.meta.list_versions(&bucket, &q)
        })
        .await
    }

    async fn list(&self, bucket: &str, q: ListQuery) -> Result<ListPage<ObjectSummary>> {
        let bucket = bucket.to_owned();
        blocking(self, move |s| {
            if s.meta.get_bucket(&bucket)?.is_none() {
                return Err(LightningError::NoSuchBucket(bucket));
            }
            s.meta.list_objects(&bucket, &q)
        })
        .await
    }

    async fn create_upload(&self, id: &str, upload: UploadMeta) -> Result<()> {
        let id = id.to_owned();
        self.meta.write(move |t| ops::create_upload(t, &id, &upload)).await
    }

    async fn upload(&self, bucket: &str, key: &str, id: &str) -> Result<UploadMeta> {
        upload_of(self, id, bucket, key)
    }

    async fn put_part(&self, id: &str, upload: &UploadMeta, number: u32, part: PartMeta, hold: Pins) -> Result<()> {
        let (id, bucket, key) = (id.to_owned(), upload.bucket.clone(), upload.key.clone());
        let freed = self.meta.write(move |t| ops::put_part(t, &id, &bucket, &key, number, &part)).await?;
        hold.release();
        self.spawn_delete(freed);
        Ok(())
    }

    async fn parts(
        &self,
        bucket: &str,
        key: &str,
        id: &str,
        after: u32,
        limit: usize,
    ) -> Result<(UploadMeta, Vec<(u32, PartMeta)>)> {
        let upload = upload_of(self, id, bucket, key)?;
        Ok((upload, self.meta.list_parts(id, after, limit)?))
    }

    async fn complete_upload(
        &self,
        bucket: &str,
        key: &str,
        id: &str,
        wanted: Vec<CompletedPart>,
        claimed: Claimed,
        cond: WriteConditions,
        accept: impl FnOnce(&UploadMeta) -> Result<()> + Send,
    ) -> Result<ObjectMeta> {
        // (A missing upload is refused in the transaction.)
        if let Some(u) = self.meta.get_upload(id)? {
            accept(&u)?;
        }
        let version = self.meta.next_version();
        let (id, b, k) = (id.to_owned(), bucket.to_owned(), key.to_owned());
        let (meta, freed) = self
            .meta
            .write(move |t| ops::complete_upload(t, &id, &b, &k, &wanted, &claimed, version, now_ms(), &cond))
            .await?;
        self.spawn_delete(freed);
        Ok(meta)
    }

    async fn abort_upload(&self, bucket: &str, key: &str, id: &str) -> Result<()> {
        let (id, b, k) = (id.to_owned(), bucket.to_owned(), key.to_owned());
        let freed = self.meta.write(move |t| ops::abort_upload(t, &id, &b, &k)).await?;
        self.spawn_delete(freed);
        Ok(())
    }

    async fn uploads(
        &self,
        bucket: &str,
        prefix: &str,
        key_marker: Option<&str>,
        id_marker: Option<&str>,
    ) -> Result<Vec<(String, String, UploadMeta)>> {
        let (bucket, prefix) = (bucket.to_owned(), prefix.to_owned());
        let (km, um) = (key_marker.map(str::to_owned), id_marker.map(str::to_owned));
        blocking(self, move |s| {
            if s.meta.get_bucket(&bucket)?.is_none() {
                return Err(LightningError::NoSuchBucket(bucket));
            }
            s.meta.list_uploads(&bucket, &prefix, km.as_deref(), um.as_deref(), 10_000)
        })
        .await
    }
}
