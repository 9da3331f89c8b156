//! Replicated multipart uploads.
//!
//! An upload lives on the replica set of its key, like the object it will
//! become: the upload row and each part row are written to every replica
//! and acknowledged after the write quorum, and a part's blocks are sent
//! the same way as a PUT's (pinned under an upload session until the part
//! row references them). Every replica keeps its block reference counts
//! exact with the engine's own `uploads` / `parts` tables.
//!
//! Completing reads the upload from a read quorum (so it sees every
//! acknowledged part), takes for each requested part the copy whose ETag
//! the client names, and commits the object row on every replica, first
//! sending a replica the blocks it lacks (it may have missed a part);
//! the object becomes visible atomically, as any row does. Then the upload
//! is dropped everywhere and remembered as *gone* (`uploads_gone`), so a
//! replica that missed the drop, or a late part, can never revive it: in a
//! quorum read a `Gone` answer wins over `Live`, and the stale replica is
//! told to drop it (and the periodic sweep finds those no read visits).

use super::NodeId;
use super::coord::union;
use super::node::{ClusterMetrics, Node};
use super::rpc::{Msg, Req, Resp, UploadState};
use crate::checksum::{Checksum, ChecksumAlgo, ChecksumPlan};
use crate::conditions::Mode;
use crate::error::{LightningError, Result};
use crate::meta::now_ms;
use crate::meta::ops::{self, CompletedPart as Wanted};
use crate::meta::types::{ObjectMeta, PartMeta, Row, UploadMeta};
use crate::s3::convert::{
    check_key, checksum_fields, checksum_headers, etag, etag_value, object_headers, timestamp, trailer_value,
};
use crate::s3::multipart::{
    checksum_type, claimed_checksums, limit, list_parts_output, list_uploads_output, part_number, upload_checksum,
    wanted_checksum,
};
use crate::s3::object::copy_source;
use crate::sse::{WithCopySourceKey as _, WithCustomerKey as _};
use bytes::Bytes;
use s3s::S3Request;
use s3s::dto::*;
use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

fn new_upload_id(node: &Node, bucket: &str, key: &str) -> String {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let mut h = blake3::Hasher::new();
    h.update(&node.hlc.now().to_le_bytes());
    h.update(&SEQ.fetch_add(1, Ordering::Relaxed).to_le_bytes());
    h.update(&super::coord::session_id().to_le_bytes());
    h.update(bucket.as_bytes());
    h.update(key.as_bytes());
    hex::encode(&h.finalize().as_bytes()[..16])
}

impl Node {
    /// Sends `make(n)` to every node of `targets` and returns those that
    /// accepted it; fails when a write set of (bucket, key) lacks its write
    /// quorum. A replica's NoSuchUpload is passed on as such.
    pub(super) async fn quorum_call(
        self: &Arc<Self>,
        bucket: &str,
        key: &[u8],
        targets: &[NodeId],
        make: impl Fn() -> Req,
    ) -> Result<HashSet<NodeId>> {
        let sets = self.write_sets(bucket, key);
        let calls = targets.iter().map(|&n| {
            let node = self.clone();
            let req = make();
            async move { (n, node.call(n, Msg::new(req)).await) }
        });
        let mut ok = HashSet::new();
        let mut gone = None;
        for (n, r) in futures::future::join_all(calls).await {
            match r {
                Ok(_) => {
                    ok.insert(n);
                }
                Err(e @ LightningError::NoSuchUpload(_)) => gone = Some(e),
                Err(e) => tracing::debug!(node = n, error = %e, "replica missed an upload write"),
            }
        }
        for s in &sets {
            let acks = s.iter().filter(|n| ok.contains(n)).count();
            if acks < self.need_w(s.len()) {
                if let Some(e) = gone {
                    return Err(e);
                }
                return Err(self.quorum_failed(&format!(
                    "only {acks} of {} replicas stored the upload change (write quorum {})",
                    s.len(),
                    self.need_w(s.len())
                )));
            }
        }
        Ok(ok)
    }

    /// Reads upload `id` of (bucket, key) from a read quorum of its
    /// replicas: the upload and (when `parts`) every replica's parts, which
    /// may hold several candidates per part number. NoSuchUpload when any
    /// replica knows it gone or none has it.
    pub async fn upload_state(
        self: &Arc<Self>,
        bucket: &str,
        key: &str,
        id: &str,
        parts: bool,
    ) -> Result<(UploadMeta, Vec<(u32, PartMeta)>)> {
        let sets = self.write_sets(bucket, key.as_bytes());
        let quorum_set = sets.last().cloned().unwrap_or_default();
        let ask = union(&sets);
        let calls = ask.iter().map(|&n| {
            let node = self.clone();
            let req = Req::GetUpload { id: id.to_owned(), parts };
            async move { (n, node.call(n, Msg::new(req)).await) }
        });
        let mut replies: Vec<(NodeId, UploadState)> = Vec::new();
        for (n, r) in futures::future::join_all(calls).await {
            if let Ok(Msg { head: Resp::Upload(s), .. }) = r {
                replies.push((n, s));
            }
        }
        let answered = quorum_set.iter().filter(|n| replies.iter().any(|(m, _)| m == *n)).count();
        if answered < self.need_r(quorum_set.len()) {
            return Err(self.quorum_failed(&format!(
                "only {answered} of {} replicas answered for the upload (read quorum {})",
                quorum_set.len(),
                self.need_r(quorum_set.len())
            )));
        }
        let no_such = || LightningError::NoSuchUpload(id.to_owned());
        if replies.iter().any(|(_, s)| *s == UploadState::Gone) {
            // Replicas still holding it missed the drop: repair them.
            for (n, s) in &replies {
                if matches!(s, UploadState::Live(..)) {
                    let (node, n) = (self.clone(), *n);
                    let req = Req::DropUpload { id: id.to_owned(), bucket: bucket.to_owned() };
                    tokio::spawn(async move {
                        if node.call(n, Msg::new(req)).await.is_ok() {
                            ClusterMetrics::inc(&node.metrics.repairs);
                        }
                    });
                }
            }
            return Err(no_such());
        }
        let mut upload = None;
        let mut all_parts = Vec::new();
        for (_, s) in replies {
            if let UploadState::Live(u, p) = s {
                if u.bucket != bucket || u.key != key {
                    return Err(no_such());
                }
                upload.get_or_insert(u);
                all_parts.extend(p);
            }
        }
        Ok((upload.ok_or_else(no_such)?, all_parts))
    }

    /// Commits `row` on every replica of (bucket, key), first sending each
    /// the blocks it lacks; acknowledged once every write set has W, with
    /// the replicas that missed it queued for resync first. Like
    /// [`Node::commit_row`], once more at a newer version if a replica of
    /// the quorum holds a newer row.
    pub async fn commit_row_filling(self: &Arc<Self>, bucket: &str, key: &[u8], row: &Row) -> Result<()> {
        let newest = self.fill_attempt(bucket, key, row).await?;
        if let Some(row) = self.above(newest, row) {
            self.fill_attempt(bucket, key, &row).await?;
        }
        Ok(())
    }

    /// One round of [`Node::commit_row_filling`]; returns the newest version
    /// the acknowledging replicas hold.
    async fn fill_attempt(self: &Arc<Self>, bucket: &str, key: &[u8], row: &Row) -> Result<u64> {
        let sets = self.write_sets(bucket, key);
        let targets = union(&sets);
        let calls = targets.iter().map(|&n| {
            let node = self.clone();
            async move { (n, node.push_row(n, bucket, key, row).await) }
        });
        let mut ok = HashSet::new();
        let mut newest = 0;
        for (n, r) in futures::future::join_all(calls).await {
            match r {
                Ok(current) => {
                    newest = newest.max(current);
                    ok.insert(n);
                }
                Err(e) => tracing::debug!(node = n, error = %e, "replica missed a completed upload"),
            }
        }
        for s in &sets {
            let acks = s.iter().filter(|n| ok.contains(n)).count();
            if acks < self.need_w(s.len()) {
                return Err(self.quorum_failed(&format!(
                    "only {acks} of {} replicas committed the object (write quorum {})",
                    s.len(),
                    self.need_w(s.len())
                )));
            }
        }
        let missed: Vec<(NodeId, String, Vec<u8>, bool)> =
            targets.iter().filter(|n| !ok.contains(n)).map(|&n| (n, bucket.to_owned(), key.to_vec(), false)).collect();
        if !missed.is_empty() {
            ClusterMetrics::inc(&self.metrics.degraded_writes);
            let node = self.clone();
            tokio::task::spawn_blocking(move || node.resync.add(&missed))
                .await
                .map_err(|e| LightningError::Io(std::io::Error::other(e)))??;
        }
        Ok(newest)
    }

    /// Drops this node's uploads that another replica knows are gone (a
    /// drop this node missed), and forgets gone markers older than the
    /// tombstone delay. Returns the uploads dropped.
    pub async fn sweep_uploads(self: &Arc<Self>) -> Result<usize> {
        let store = self.store.clone();
        let keep_ms = i64::try_from(self.config().tombstone_secs.saturating_mul(1000)).unwrap_or(i64::MAX);
        let before = now_ms().saturating_sub(keep_ms);
        let (live, old) = tokio::task::spawn_blocking(move || {
            let live = store.meta.all_uploads()?;
            let (_, old) = store.meta.gone_uploads("", before)?;
            Ok::<_, LightningError>((live, old))
        })
        .await
        .map_err(|e| LightningError::Io(std::io::Error::other(e)))??;
        for id in old {
            self.store.meta.write(move |t| ops::forget_gone_upload(t, &id)).await?;
        }
        let mut dropped = 0;
        for (id, u) in live {
            let peers: Vec<NodeId> =
                union(&self.write_sets(&u.bucket, u.key.as_bytes())).into_iter().filter(|n| *n != self.id).collect();
            for n in peers {
                let req = Req::GetUpload { id: id.clone(), parts: false };
                if let Ok(Msg { head: Resp::Upload(UploadState::Gone), .. }) = self.call(n, Msg::new(req)).await {
                    let (id, b, now) = (id.clone(), u.bucket.clone(), now_ms());
                    let freed = self.store.meta.write(move |t| ops::drop_upload(t, &id, &b, now)).await?;
                    self.store.spawn_delete(freed);
                    ClusterMetrics::inc(&self.metrics.repairs);
                    dropped += 1;
                    break;
                }
            }
        }
        Ok(dropped)
    }

    /// Stages a part's body on the replicas (encrypted when `sealing`, for
    /// an SSE-C upload) and stores its row there. `check` sees the size and
    /// the plaintext's MD5 and checksum before anything is committed.
    #[allow(clippy::too_many_arguments)]
    async fn stage_part<S, E>(
        self: &Arc<Self>,
        bucket: &str,
        key: &str,
        id: &str,
        upload: UploadMeta,
        number: u32,
        body: S,
        algo: Option<ChecksumAlgo>,
        sealing: Option<(crate::sse::SseC, crate::sse::Cipher)>,
        check: impl FnOnce(u64, &[u8; 16], Option<&Checksum>) -> Result<()>,
    ) -> Result<PartMeta>
    where
        S: futures::Stream<Item = std::result::Result<Bytes, E>> + Send,
        E: std::fmt::Display,
    {
        let (staged, plain_md5, checksum, sse_iv) = match sealing {
            None => {
                let staged = self.stage(bucket, key.as_bytes(), body, algo, false).await?;
                let (md5, checksum) = (staged.md5, staged.checksum.clone());
                (staged, md5, checksum, None)
            }
            Some((sse, cipher)) => {
                let (sealed, digest) = crate::sse::seal_body(cipher, algo, body);
                let staged = self.stage(bucket, key.as_bytes(), sealed, None, false).await?;
                let (md5, checksum) = digest.finish()?;
                (staged, md5, checksum, Some(sse.iv))
            }
        };
        check(staged.size, &plain_md5, checksum.as_ref())?;
        let part = PartMeta {
            size: staged.size,
            md5: staged.md5,
            checksum,
            last_modified_ms: now_ms(),
            blocks: staged.data.blocks().to_vec(),
            sse_iv,
        };
        let targets: Vec<NodeId> = union(&self.write_sets(bucket, key.as_bytes()))
            .into_iter()
            .filter(|n| staged.complete.contains(n))
            .collect();
        let session = staged.session;
        self.quorum_call(bucket, key.as_bytes(), &targets, || Req::PutPart {
            session,
            id: id.to_owned(),
            upload: upload.clone(),
            number,
            part: part.clone(),
        })
        .await?;
        Ok(part)
    }
}

pub(super) async fn create_multipart_upload(
    node: &Arc<Node>,
    req: S3Request<CreateMultipartUploadInput>,
) -> Result<CreateMultipartUploadOutput> {
    let i = req.input;
    check_key(&i.key)?;
    let (algo, full_object) = upload_checksum(&i)?;
    let sse_c_key_md5 = i.customer_key()?.map(|k| k.md5());
    node.require_bucket(&i.bucket).await?;
    let id = new_upload_id(node, &i.bucket, &i.key);
    let upload = UploadMeta {
        bucket: i.bucket.clone(),
        key: i.key.clone(),
        initiated_ms: now_ms(),
        headers: object_headers(
            i.content_type,
            i.content_encoding,
            i.content_disposition,
            i.content_language,
            i.cache_control,
            i.expires.as_ref(),
            i.metadata,
        ),
        checksum_algo: algo,
        full_object,
        sse_c_key_md5,
    };
    let targets = union(&node.write_sets(&i.bucket, i.key.as_bytes()));
    node.quorum_call(&i.bucket, i.key.as_bytes(), &targets, || Req::CreateUpload {
        id: id.clone(),
        upload: upload.clone(),
    })
    .await?;
    Ok(CreateMultipartUploadOutput {
        bucket: Some(i.bucket),
        key: Some(i.key),
        upload_id: Some(id),
        checksum_algorithm: i.checksum_algorithm,
        checksum_type: checksum_type(algo, full_object),
        sse_customer_algorithm: sse_c_key_md5.map(|_| crate::sse::ALGORITHM.to_owned()),
        sse_customer_key_md5: sse_c_key_md5.as_ref().map(crate::sse::key_md5_base64_of),
        ..Default::default()
    })
}

pub(super) async fn upload_part(node: &Arc<Node>, req: S3Request<UploadPartInput>) -> Result<UploadPartOutput> {
    let S3Request { input: i, headers, trailing_headers, .. } = req;
    let number = part_number(i.part_number)?;
    let given = i.customer_key()?;
    let (upload, _) = node.upload_state(&i.bucket, &i.key, &i.upload_id, false).await?;
    let sse_md5 = upload.sse_c_key_md5;
    let sealing = crate::sse::for_upload(sse_md5, given)?.map(|k| k.seal()).transpose()?;
    let plan = ChecksumPlan::from_headers(&checksum_headers(
        &headers,
        i.content_md5.as_deref(),
        i.checksum_algorithm.as_ref(),
        i.checksum_crc32.as_deref(),
        i.checksum_crc32c.as_deref(),
        i.checksum_crc64nvme.as_deref(),
        i.checksum_sha1.as_deref(),
        i.checksum_sha256.as_deref(),
    ))?;
    let algo = plan.algo.or(upload.checksum_algo);
    let declared = i.content_length;
    // As for a PUT: the client's digests are of the plaintext, the ETag is
    // the MD5 of what is stored.
    let check = |size: u64, md5: &[u8; 16], checksum: Option<&Checksum>| {
        if let Some(declared) = declared
            && u64::try_from(declared).ok() != Some(size)
        {
            return Err(LightningError::IncompleteBody { declared: u64::try_from(declared).unwrap_or(0), got: size });
        }
        let trailer = trailer_value(trailing_headers.as_ref(), plan.algo);
        plan.verify(md5, checksum, trailer.as_deref())
    };
    let (b, k, id) = (&i.bucket, &i.key, &i.upload_id);
    let part = match i.body {
        Some(body) => node.stage_part(b, k, id, upload, number, body, algo, sealing, check).await?,
        None => {
            let empty = futures::stream::empty::<std::result::Result<Bytes, String>>();
            node.stage_part(b, k, id, upload, number, empty, algo, sealing, check).await?
        }
    };
    let c = checksum_fields(part.checksum.as_ref());
    Ok(UploadPartOutput {
        e_tag: Some(etag(&part.etag())),
        checksum_crc32: c.crc32,
        checksum_crc32c: c.crc32c,
        checksum_crc64nvme: c.crc64nvme,
        checksum_sha1: c.sha1,
        checksum_sha256: c.sha256,
        sse_customer_algorithm: sse_md5.map(|_| crate::sse::ALGORITHM.to_owned()),
        sse_customer_key_md5: sse_md5.as_ref().map(crate::sse::key_md5_base64_of),
        ..Default::default()
    })
}

pub(super) async fn upload_part_copy(
    node: &Arc<Node>,
    req: S3Request<UploadPartCopyInput>,
) -> Result<UploadPartCopyOutput> {
    let i = req.input;
    let number = part_number(i.part_number)?;
    let (given, source_key) = (i.customer_key()?, i.copy_source_key()?);
    let (upload, _) = node.upload_state(&i.bucket, &i.key, &i.upload_id, false).await?;
    let sse_md5 = upload.sse_c_key_md5;
    let dest_key = crate::sse::for_upload(sse_md5, given)?;
    let (sb, sk) = copy_source(&i.copy_source)?;
    let (src, holders) = super::s3::load(node, &sb, &sk).await?;
    let source = crate::sse::open(&src, source_key.as_ref())?;
    crate::conditions::Preconditions {
        if_match: i.copy_source_if_match,
        if_none_match: i.copy_source_if_none_match,
        if_modified_since: i.copy_source_if_modified_since.as_ref().map(crate::s3::convert::unix_secs),
        if_unmodified_since: i.copy_source_if_unmodified_since.as_ref().map(crate::s3::convert::unix_secs),
    }
    .check(&src.etag, src.last_modified_secs(), Mode::Copy)?;
    let range = match &i.copy_source_range {
        None => 0..src.size,
        Some(r) => crate::s3::convert::copy_source_range(r, src.size)?,
    };
    // The destination's replicas may differ from the source's: stream the
    // range through the normal part path (decrypted, then encrypted for the
    // upload under SSE-C).
    let body = crate::sse::decrypting(source, range.start, node.read_body(&src, range, holders));
    let sealing = dest_key.map(|k| k.seal()).transpose()?;
    let algo = upload.checksum_algo;
    let (b, k, id) = (&i.bucket, &i.key, &i.upload_id);
    let part = node.stage_part(b, k, id, upload, number, body, algo, sealing, |_, _, _| Ok(())).await?;
    Ok(UploadPartCopyOutput {
        copy_part_result: Some(CopyPartResult {
            e_tag: Some(etag(&part.etag())),
            last_modified: Some(timestamp(part.last_modified_ms)),
            ..Default::default()
        }),
        sse_customer_algorithm: sse_md5.map(|_| crate::sse::ALGORITHM.to_owned()),
        sse_customer_key_md5: sse_md5.as_ref().map(crate::sse::key_md5_base64_of),
        ..Default::default()
    })
}

pub(super) async fn complete_multipart_upload(
    node: &Arc<Node>,
    req: S3Request<CompleteMultipartUploadInput>,
) -> Result<CompleteMultipartUploadOutput> {
    let i = req.input;
    let claimed = claimed_checksums(&i)?;
    let given_key = i.customer_key()?;
    let parts = i.multipart_upload.and_then(|m| m.parts).unwrap_or_default();
    let mut wanted = Vec::with_capacity(parts.len());
    for p in &parts {
        let number = part_number(p.part_number.unwrap_or(0))?;
        let etag = p.e_tag.as_ref().map(etag_value).unwrap_or_default().to_owned();
        wanted.push(Wanted { number, etag, checksum: wanted_checksum(p)? });
    }
    let (upload, stored) = match node.upload_state(&i.bucket, &i.key, &i.upload_id, true).await {
        Ok(s) => s,
        // A retry of a completion that happened (its reply was lost): the
        // same answer again, as the single node gives it.
        Err(e @ LightningError::NoSuchUpload(_)) => {
            let want = ops::completed_etag(&wanted);
            return match super::s3::load(node, &i.bucket, &i.key).await {
                Ok((m, _)) if want.as_deref() == Some(m.etag.as_str()) => {
                    Ok(complete_output(&i.bucket, &i.key, &m, given_key.as_ref()))
                }
                _ => Err(e),
            };
        }
        Err(e) => return Err(e),
    };
    // SSE-C headers are optional on completion; given, they must be the upload's.
    if let Some(k) = given_key.clone() {
        crate::sse::for_upload(upload.sse_c_key_md5, Some(k))?;
    }
    let meta = if i.if_match.is_some() || i.if_none_match.is_some() {
        node.with_key_lease(&i.bucket, i.key.as_bytes(), async {
            super::s3::check_write_conditions(node, &i.bucket, &i.key, i.if_match.as_ref(), i.if_none_match.as_ref())
                .await?;
            let meta = ops::assemble_upload(&upload, &wanted, &stored, node.hlc.now(), now_ms())?;
            ops::check_claimed_checksums(&upload, &meta, &claimed)?;
            node.commit_row_filling(&i.bucket, i.key.as_bytes(), &Row::Object(meta.clone())).await?;
            Ok(meta)
        })
        .await?
    } else {
        let meta = ops::assemble_upload(&upload, &wanted, &stored, node.hlc.now(), now_ms())?;
        ops::check_claimed_checksums(&upload, &meta, &claimed)?;
        node.commit_row_filling(&i.bucket, i.key.as_bytes(), &Row::Object(meta.clone())).await?;
        meta
    };
    // The object is committed: dropping the upload is cleanup. Replicas
    // that miss it are fixed by reads that see them and by the sweep.
    let targets = union(&node.write_sets(&i.bucket, i.key.as_bytes()));
    if let Err(e) = node
        .quorum_call(&i.bucket, i.key.as_bytes(), &targets, || Req::DropUpload {
            id: i.upload_id.clone(),
            bucket: i.bucket.clone(),
        })
        .await
    {
        tracing::warn!(upload = %i.upload_id, error = %e, "completed upload not dropped everywhere yet");
    }
    Ok(complete_output(&i.bucket, &i.key, &meta, given_key.as_ref()))
}

/// The completion's answer; the object's plaintext checksum only as
/// [`crate::sse::may_show_checksum`] allows.
fn complete_output(
    bucket: &str,
    key: &str,
    meta: &ObjectMeta,
    given: Option<&crate::sse::CustomerKey>,
) -> CompleteMultipartUploadOutput {
    let show = crate::sse::may_show_checksum(meta, given);
    let c = checksum_fields(meta.checksum.as_ref().filter(|_| show));
    CompleteMultipartUploadOutput {
        bucket: Some(bucket.to_owned()),
        key: Some(key.to_owned()),
        location: Some(format!("/{bucket}/{key}")),
        e_tag: Some(etag(&meta.etag)),
        checksum_crc32: c.crc32,
        checksum_crc32c: c.crc32c,
        checksum_crc64nvme: c.crc64nvme,
        checksum_sha1: c.sha1,
        checksum_sha256: c.sha256,
        checksum_type: c.kind,
        ..Default::default()
    }
}

pub(super) async fn abort_multipart_upload(
    node: &Arc<Node>,
    req: S3Request<AbortMultipartUploadInput>,
) -> Result<AbortMultipartUploadOutput> {
    let i = req.input;
    abort_upload(node, &i.bucket, &i.key, &i.upload_id).await?;
    Ok(AbortMultipartUploadOutput::default())
}

/// Aborts an upload on its replicas (AbortMultipartUpload and lifecycle):
/// NoSuchUpload unless a quorum read finds it in progress.
pub(super) async fn abort_upload(node: &Arc<Node>, bucket: &str, key: &str, id: &str) -> Result<()> {
    node.upload_state(bucket, key, id, false).await?;
    let targets = union(&node.write_sets(bucket, key.as_bytes()));
    node.quorum_call(bucket, key.as_bytes(), &targets, || Req::DropUpload {
        id: id.to_owned(),
        bucket: bucket.to_owned(),
    })
    .await?;
    Ok(())
}

pub(super) async fn list_parts(node: &Arc<Node>, req: S3Request<ListPartsInput>) -> Result<ListPartsOutput> {
    let i = req.input;
    let max = limit(i.max_parts, "max-parts")?;
    let (upload, stored) = node.upload_state(&i.bucket, &i.key, &i.upload_id, true).await?;
    // Replicas may differ on a re-uploaded part: the newest copy wins.
    let mut merged: BTreeMap<u32, PartMeta> = BTreeMap::new();
    for (n, p) in stored {
        match merged.get(&n) {
            Some(cur) if (cur.last_modified_ms, cur.etag()) >= (p.last_modified_ms, p.etag()) => {}
            _ => {
                merged.insert(n, p);
            }
        }
    }
    let marker = u32::try_from(i.part_number_marker.unwrap_or(0)).unwrap_or(0);
    let rows: Vec<(u32, PartMeta)> = merged.into_iter().filter(|(n, _)| *n > marker).take(max + 1).collect();
    list_parts_output(i, &upload, rows, max)
}

pub(super) async fn list_multipart_uploads(
    node: &Arc<Node>,
    req: S3Request<ListMultipartUploadsInput>,
) -> Result<ListMultipartUploadsOutput> {
    let i = req.input;
    node.require_bucket(&i.bucket).await?;
    let max = limit(i.max_uploads, "max-uploads")?;
    let prefix = i.prefix.clone().unwrap_or_default();
    let calls = node.all_nodes().into_iter().map(|n| {
        let node = node.clone();
        let req = Req::ListUploads { bucket: i.bucket.clone(), prefix: prefix.clone() };
        async move { (n, node.call(n, Msg::new(req)).await) }
    });
    let mut answered = HashSet::new();
    let mut live: BTreeMap<(String, String), UploadMeta> = BTreeMap::new();
    let mut gone: HashSet<String> = HashSet::new();
    for (n, r) in futures::future::join_all(calls).await {
        if let Ok(Msg { head: Resp::Uploads { live: l, gone: g }, .. }) = r {
            answered.insert(n);
            gone.extend(g);
            for (key, id, u) in l {
                live.insert((key, id), u);
            }
        }
    }
    node.check_coverage(&answered, "list-multipart-uploads")?;
    let (km, um) = (i.key_marker.clone(), i.upload_id_marker.clone());
    let rows = live.into_iter().filter(|((key, id), _)| {
        !gone.contains(id)
            && match (&km, &um) {
                (Some(m), Some(um)) => (key.as_str(), id.as_str()) > (m.as_str(), um.as_str()),
                (Some(m), None) => key.as_str() > m.as_str(),
                (None, _) => true,
            }
    });
    Ok(list_uploads_output(i, max, rows.map(|((key, id), u)| (key, id, u))))
}
