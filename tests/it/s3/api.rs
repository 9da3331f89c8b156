//! LightningStor driven by aws-sdk-s3: in process (the s3s service plugged in
//! as the SDK's HTTP client) and as the spawned `lightningstor` binary.

use super::common as s3_common;

use aws_sdk_s3::presigning::PresigningConfig;
use aws_sdk_s3::primitives::{ByteStream, DateTime};
use aws_sdk_s3::types::{
    ChecksumAlgorithm, ChecksumMode, CompletedMultipartUpload, CompletedPart, Delete, EncodingType, MetadataDirective,
    ObjectIdentifier,
};
use md5::Digest as _;
use s3_common::*;
use std::time::Duration;

type R = anyhow::Result<()>;

/// Runs each named test body against a single node and against a 3-node
/// in-process cluster whose client rotates requests over the nodes.
macro_rules! single_node_and_cluster {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            #[tokio::test]
            async fn single_node() -> super::R {
                let _gate = crate::gate::shared();
                let s = super::InProcess::new();
                super::$name(s.client()).await
            }

            #[tokio::test]
            async fn three_node_cluster() -> super::R {
                let _gate = crate::gate::shared();
                let s = super::InCluster::new(3);
                super::$name(s.client()).await
            }
        }
    )*};
}

single_node_and_cluster!(
    buckets_can_be_created_listed_located_and_deleted_only_when_empty,
    invalid_bucket_names_are_rejected,
    objects_round_trip_with_metadata_and_standard_headers,
    range_gets_cover_first_last_open_ended_and_suffix_forms,
    conditional_gets_and_heads_answer_304_and_412,
    gets_and_heads_honour_every_response_header_override,
    conditional_puts_honour_if_none_match_and_if_match,
    copies_keep_or_replace_metadata_and_check_source_conditions,
    a_copy_asking_for_a_checksum_algorithm_stores_and_returns_that_checksum,
    delete_objects_removes_a_batch_and_reports_each_key,
    listings_page_through_prefixes_delimiters_and_markers,
    multipart_uploads_complete_with_an_s3_style_etag,
    multipart_uploads_are_listed_by_prefix_and_page_by_markers,
    max_keys_zero_and_max_buckets_page_as_s3_does,
    options_we_do_not_implement_are_refused_and_nothing_is_stored,
    an_expected_bucket_owner_is_refused_on_bucket_listing_and_upload_operations,
    conditional_deletes_keep_the_object_when_a_condition_fails,
    a_repeated_complete_multipart_upload_gets_the_same_answer,
    a_complete_into_a_bucket_deleted_meanwhile_fails_with_no_such_bucket,
    a_complete_claiming_a_wrong_object_checksum_is_refused_and_the_upload_stays,
    replies_carry_a_request_id_and_error_xml_repeats_it,
    sse_c_objects_are_served_only_with_their_key,
    sse_c_copies_need_the_source_key_and_may_change_or_drop_the_key,
    full_object_multipart_checksums_are_the_crc_of_the_whole_object,
    operations_we_do_not_serve_answer_not_implemented,
    lifecycle_configurations_round_trip_and_unsupported_rules_are_refused,
);

/// SSE-C multipart tests that also look at the bytes on disk: a single node
/// and a 3-node cluster, each with its data directory.
mod sse_c_multipart {
    use super::*;

    #[tokio::test]
    async fn sse_c_multipart_uploads_need_the_key_on_every_part_single_node() -> R {
        let _gate = crate::gate::shared();
        let s = InProcess::new();
        super::sse_c_multipart_uploads_need_the_key_on_every_part(s.client(), s.dir.path()).await
    }

    #[tokio::test]
    async fn sse_c_multipart_uploads_need_the_key_on_every_part_three_node_cluster() -> R {
        let _gate = crate::gate::shared();
        let s = InCluster::new(3);
        super::sse_c_multipart_uploads_need_the_key_on_every_part(s.client(), s.dir.path()).await
    }
}

/// `consistency = "degraded"` exists only on a cluster (a single node checks
/// write conditions in its own transaction): there a key lease is not
/// exclusive, so every conditional write is refused with 501 NotImplemented
/// naming degraded consistency, nothing changes, and unconditional writes go on.
mod degraded {
    use super::*;

    fn not_implemented<T, E: aws_sdk_s3::error::ProvideErrorMetadata, Raw: HasStatus>(
        r: Result<T, aws_sdk_s3::error::SdkError<E, Raw>>,
    ) {
        let Err(e) = r else { panic!("a conditional write in degraded mode succeeded") };
        assert_eq!((code(&e), status(&e)), ("NotImplemented".to_owned(), 501));
        let msg = aws_sdk_s3::error::ProvideErrorMetadata::message(&e).unwrap_or_default().to_owned();
        assert!(msg.contains("degraded"), "{msg}");
    }

    #[tokio::test]
    async fn conditional_writes_are_refused_in_degraded_mode_three_node_cluster() -> R {
        let _gate = crate::gate::shared();
        let s = InCluster::with(3, |c| c.consistency = lightningstor::cluster::Consistency::Degraded);
        let c = s.client();
        c.create_bucket().bucket("deg").send().await?;
        let body = || ByteStream::from_static(b"v1");
        not_implemented(c.put_object().bucket("deg").key("k").if_none_match("*").body(body()).send().await);
        let e = c.head_object().bucket("deg").key("k").send().await.expect_err("nothing stored");
        assert_eq!(status(&e), 404);
        let etag = put(&c, "deg", "k", b"v1").await;
        not_implemented(c.put_object().bucket("deg").key("k").if_match(&etag).body(body()).send().await);
        not_implemented(c.delete_object().bucket("deg").key("k").if_match(&etag).send().await);
        let id = c.create_multipart_upload().bucket("deg").key("m").send().await?.upload_id.expect("upload id");
        let p = c.upload_part().bucket("deg").key("m").upload_id(&id).part_number(1).body(body()).send().await?;
        let parts = CompletedMultipartUpload::builder()
            .parts(CompletedPart::builder().part_number(1).e_tag(p.e_tag.expect("etag")).build())
            .build();
        let complete =
            || c.complete_multipart_upload().bucket("deg").key("m").upload_id(&id).multipart_upload(parts.clone());
        not_implemented(complete().if_none_match("*").send().await);
        // Nothing changed: the object and the upload are as they were.
        assert_eq!(c.head_object().bucket("deg").key("k").send().await?.e_tag(), Some(etag.as_str()));
        assert_eq!(c.list_parts().bucket("deg").key("m").upload_id(&id).send().await?.parts().len(), 1);
        complete().send().await?;
        assert_eq!(body_of(c.get_object().bucket("deg").key("m").send().await?).await, b"v1");
        Ok(())
    }
}

/// Lifecycle tests need a short "day" and a frequent task, and one needs a
/// second key: a single node and a 3-node cluster each set that up here.
mod lifecycle {
    use super::*;
    use lightningstor::keys::Keyring;
    use std::sync::Arc;
    use std::sync::atomic::Ordering::Relaxed;

    fn short_days(c: lightningstor::Config) -> lightningstor::Config {
        lightningstor::Config { lifecycle_day_secs: 1, lifecycle_interval_secs: 1, ..c.with_keys(AK, SK) }
    }

    #[tokio::test]
    async fn rules_expire_old_objects_by_prefix_and_abort_old_uploads_single_node() -> R {
        let _gate = crate::gate::shared();
        let s = InProcess::with(short_days);
        let _task = lightningstor::server::spawn_background(&s.store);
        let store = s.store.clone();
        let counts = move || {
            let m = &store.metrics;
            (m.lifecycle_expired.load(Relaxed), m.lifecycle_aborted.load(Relaxed))
        };
        super::rules_expire_old_objects_by_prefix_and_abort_old_uploads(s.client(), counts).await
    }

    #[tokio::test]
    async fn rules_expire_old_objects_by_prefix_and_abort_old_uploads_three_node_cluster() -> R {
        let _gate = crate::gate::shared();
        let s = InCluster::with(3, |c| {
            c.lifecycle_day_secs = 1;
            c.lifecycle_interval_secs = 1;
        });
        let nodes: Vec<_> = s.cluster.ids().into_iter().map(|i| s.cluster.node(i)).collect();
        let all = nodes.clone();
        let counts = move || {
            all.iter().fold((0, 0), |(e, a), n| {
                let m = &n.store.metrics;
                (e + m.lifecycle_expired.load(Relaxed), a + m.lifecycle_aborted.load(Relaxed))
            })
        };
        super::rules_expire_old_objects_by_prefix_and_abort_old_uploads(s.client(), counts).await?;
        // Every node is up, so each key was handled by the first node of its
        // replica set, and by no other.
        let first = |key: &str| nodes[0].write_sets("life", key.as_bytes())[0][0];
        for n in &nodes {
            let expired = ["tmp/a", "tmp/b", "tmp/c/d"].iter().filter(|k| first(k) == n.id).count() as u64;
            let aborted = u64::from(first("keep/big") == n.id);
            let m = &n.store.metrics;
            let got = (m.lifecycle_expired.load(Relaxed), m.lifecycle_aborted.load(Relaxed));
            assert_eq!(got, (expired, aborted), "node {}", n.id);
        }
        Ok(())
    }

    /// Expiration on a versioned bucket: the expired current object gets a
    /// delete marker and stays as a noncurrent version, as in S3.
    #[tokio::test]
    async fn expiration_in_a_versioned_bucket_adds_a_delete_marker_single_node() -> R {
        let _gate = crate::gate::shared();
        use aws_sdk_s3::types::BucketLifecycleConfiguration;
        let s = InProcess::with(short_days);
        let _task = lightningstor::server::spawn_background(&s.store);
        let c = s.client();
        c.create_bucket().bucket("life").send().await?;
        c.put_bucket_versioning().bucket("life").versioning_configuration(super::enabled()).send().await?;
        let v = super::put_version(&c, "life", "tmp/a", b"old").await;
        put(&c, "life", "keep", b"kept").await;
        let config = BucketLifecycleConfiguration::builder()
            .rules(lifecycle_rule("tmp", Some("tmp/")).expiration(expire_after(1)).build()?)
            .build()?;
        c.put_bucket_lifecycle_configuration().bucket("life").lifecycle_configuration(config).send().await?;
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while keys_of(&c, "life").await? != ["keep"] {
            assert!(std::time::Instant::now() < deadline, "lifecycle did not expire tmp/a");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let out = c.list_object_versions().bucket("life").prefix("tmp/").send().await?;
        assert_eq!(out.versions().len(), 1);
        assert_eq!(out.versions()[0].version_id(), Some(v.as_str()));
        assert_eq!(out.versions()[0].is_latest(), Some(false));
        assert_eq!(out.delete_markers().len(), 1);
        assert_eq!(out.delete_markers()[0].is_latest(), Some(true));
        let got = c.get_object().bucket("life").key("tmp/a").version_id(&v).send().await?;
        assert_eq!(body_of(got).await, b"old");
        Ok(())
    }

    #[tokio::test]
    async fn lifecycle_needs_the_owner_permission_single_node() -> R {
        let _gate = crate::gate::shared();
        let s = InProcess::new();
        let kr: Arc<dyn Keyring> = s.store.clone();
        let bob = |id: &str, secret: &str| s.client_with(id, secret);
        super::lifecycle_needs_the_owner_permission(s.client(), kr, bob).await
    }

    #[tokio::test]
    async fn lifecycle_needs_the_owner_permission_three_node_cluster() -> R {
        let _gate = crate::gate::shared();
        let s = InCluster::new(3);
        let kr: Arc<dyn Keyring> = s.cluster.coordinator(1);
        let bob = |id: &str, secret: &str| {
            let conf = sdk_config("http://localhost:9000", id, secret)
                .http_client(testkit::sdk::InProcess::from(s.service()))
                .build();
            aws_sdk_s3::Client::from_conf(conf)
        };
        super::lifecycle_needs_the_owner_permission(s.client(), kr, bob).await
    }
}

/// Tests that send raw signed requests, run against a single node and a
/// 3-node cluster (node 1's service).
macro_rules! raw_single_node_and_cluster {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            #[tokio::test]
            async fn single_node() -> super::R {
                let _gate = crate::gate::shared();
                let s = super::InProcess::new();
                super::$name(s.client(), s.service.clone()).await
            }

            #[tokio::test]
            async fn three_node_cluster() -> super::R {
                let _gate = crate::gate::shared();
                let s = super::InCluster::new(3);
                super::$name(s.client_of(1), s.cluster.service(1)).await
            }
        }
    )*};
}

raw_single_node_and_cluster!(
    a_body_that_does_not_match_its_signed_sha256_is_refused_and_not_stored,
    presigned_urls_valid_for_more_than_seven_days_are_refused,
    aws_chunked_trailing_checksums_are_verified,
);

async fn body_of(out: aws_sdk_s3::operation::get_object::GetObjectOutput) -> Vec<u8> {
    out.body.collect().await.expect("body").into_bytes().to_vec()
}

async fn put(c: &aws_sdk_s3::Client, b: &str, k: &str, data: &[u8]) -> String {
    c.put_object()
        .bucket(b)
        .key(k)
        .body(ByteStream::from(data.to_vec()))
        .send()
        .await
        .expect("put")
        .e_tag
        .expect("etag")
}

async fn buckets_can_be_created_listed_located_and_deleted_only_when_empty(c: aws_sdk_s3::Client) -> R {
    c.create_bucket().bucket("alpha").send().await?;
    c.create_bucket().bucket("beta").send().await?;
    let e = c.create_bucket().bucket("alpha").send().await.expect_err("dup");
    assert_eq!(code(&e), "BucketAlreadyOwnedByYou");
    c.head_bucket().bucket("alpha").send().await?;
    let e = c.head_bucket().bucket("gamma").send().await.expect_err("missing");
    assert_eq!(status(&e), 404);
    let names: Vec<_> =
        c.list_buckets().send().await?.buckets().iter().filter_map(|b| b.name().map(str::to_owned)).collect();
    assert_eq!(names, ["alpha", "beta"]);
    let loc = c.get_bucket_location().bucket("alpha").send().await?;
    assert!(loc.location_constraint().is_none_or(|l| l.as_str().is_empty()));

    put(&c, "alpha", "k", b"x").await;
    let e = c.delete_bucket().bucket("alpha").send().await.expect_err("not empty");
    assert_eq!(code(&e), "BucketNotEmpty");
    c.delete_object().bucket("alpha").key("k").send().await?;
    c.delete_bucket().bucket("alpha").send().await?;
    let e = c.delete_bucket().bucket("alpha").send().await.expect_err("gone");
    assert_eq!(code(&e), "NoSuchBucket");

    // Uploads in progress do not keep a bucket alive: as in S3, they go with it.
    let up = c.create_multipart_upload().bucket("beta").key("big").send().await?;
    let id = up.upload_id().expect("upload id").to_owned();
    c.upload_part()
        .bucket("beta")
        .key("big")
        .upload_id(&id)
        .part_number(1)
        .body(ByteStream::from_static(b"part one"))
        .send()
        .await?;
    c.delete_bucket().bucket("beta").send().await?;
    let e = c.head_bucket().bucket("beta").send().await.expect_err("deleted");
    assert_eq!(status(&e), 404);
    c.create_bucket().bucket("beta").send().await?;
    assert!(c.list_multipart_uploads().bucket("beta").send().await?.uploads().is_empty());
    let e = c.list_parts().bucket("beta").key("big").upload_id(&id).send().await.expect_err("upload gone");
    assert_eq!(code(&e), "NoSuchUpload");
    Ok(())
}

async fn invalid_bucket_names_are_rejected(c: aws_sdk_s3::Client) -> R {
    for bad in ["ab", "UPPER", "a..b", "under_score", "-dash", "foo-.bar", "foo.-bar", "name-s3alias", "xn--abc"] {
        let e = c.create_bucket().bucket(bad).send().await.expect_err(bad);
        assert_eq!(code(&e), "InvalidBucketName", "{bad}");
    }
    Ok(())
}

async fn objects_round_trip_with_metadata_and_standard_headers(c: aws_sdk_s3::Client) -> R {
    c.create_bucket().bucket("bkt").send().await?;
    let data = pseudo_random(3 * 1024 * 1024 + 123, 1);
    let etag = c
        .put_object()
        .bucket("bkt")
        .key("dir/obj.bin")
        .body(ByteStream::from(data.clone()))
        .content_type("application/x-test")
        .cache_control("max-age=60")
        .content_disposition("attachment")
        .content_language("en")
        .content_encoding("identity")
        .metadata("colour", "blue")
        .metadata("size", "large")
        .send()
        .await?
        .e_tag
        .expect("etag");
    assert_eq!(etag, format!("\"{}\"", hex::encode(md5::Md5::digest(&data))));
    let out = c.get_object().bucket("bkt").key("dir/obj.bin").send().await?;
    assert_eq!(out.content_type(), Some("application/x-test"));
    assert_eq!(out.cache_control(), Some("max-age=60"));
    assert_eq!(out.content_disposition(), Some("attachment"));
    assert_eq!(out.content_language(), Some("en"));
    assert_eq!(out.e_tag(), Some(etag.as_str()));
    assert_eq!(out.content_length(), Some(data.len() as i64));
    let meta = out.metadata().cloned().unwrap_or_default();
    assert_eq!(meta.get("colour").map(String::as_str), Some("blue"));
    assert_eq!(meta.get("size").map(String::as_str), Some("large"));
    assert_eq!(body_of(out).await, data);

    let head = c.head_object().bucket("bkt").key("dir/obj.bin").send().await?;
    assert_eq!(head.content_length(), Some(data.len() as i64));
    assert_eq!(head.e_tag(), Some(etag.as_str()));

    // Empty objects and overwrites.
    put(&c, "bkt", "empty", b"").await;
    let out = c.get_object().bucket("bkt").key("empty").send().await?;
    assert!(body_of(out).await.is_empty());
    put(&c, "bkt", "dir/obj.bin", b"short now").await;
    let out = c.get_object().bucket("bkt").key("dir/obj.bin").send().await?;
    assert_eq!(body_of(out).await, b"short now");

    let e = c.get_object().bucket("bkt").key("nope").send().await.expect_err("missing");
    assert_eq!(code(&e), "NoSuchKey");
    let e = c.get_object().bucket("nob").key("k").send().await.expect_err("no bucket");
    assert_eq!(code(&e), "NoSuchBucket");
    Ok(())
}

#[tokio::test]
async fn keys_are_arbitrary_utf8_and_never_paths() -> R {
    let _gate = crate::gate::shared();
    let s = InProcess::new();
    let c = s.client();
    c.create_bucket().bucket("bkt").send().await?;
    let long = "é".repeat(512); // 1024 bytes
    let keys = [
        "../../etc/passwd",
        "a//b/./c/..",
        "spaces and ?query=&#frag",
        "ünïcødé/日本語/🚀",
        "%2F%00-percent",
        long.as_str(),
    ];
    for (i, k) in keys.iter().enumerate() {
        put(&c, "bkt", k, format!("value {i}").as_bytes()).await;
    }
    for (i, k) in keys.iter().enumerate() {
        let out = c.get_object().bucket("bkt").key(*k).send().await?;
        assert_eq!(body_of(out).await, format!("value {i}").as_bytes(), "{k}");
    }
    let listed: Vec<String> = c
        .list_objects_v2()
        .bucket("bkt")
        .send()
        .await?
        .contents()
        .iter()
        .filter_map(|o| o.key().map(str::to_owned))
        .collect();
    let mut want: Vec<String> = keys.iter().map(|k| k.to_string()).collect();
    want.sort();
    assert_eq!(listed, want);
    // Keys never became paths: the data directory holds only the database and blocks.
    let mut entries: Vec<String> = std::fs::read_dir(s.dir.path())?
        .map(|e| e.map(|e| e.file_name().to_string_lossy().into_owned()))
        .collect::<Result<_, _>>()?;
    entries.sort();
    assert_eq!(entries, ["blocks", "meta.redb"]);
    let too_long = "x".repeat(1025);
    let e = c
        .put_object()
        .bucket("bkt")
        .key(&too_long)
        .body(ByteStream::from_static(b"x"))
        .send()
        .await
        .expect_err("too long");
    assert_eq!(code(&e), "KeyTooLongError");
    Ok(())
}

async fn range_gets_cover_first_last_open_ended_and_suffix_forms(c: aws_sdk_s3::Client) -> R {
    c.create_bucket().bucket("bkt").send().await?;
    let data = pseudo_random(2 * 1024 * 1024 + 77, 2);
    put(&c, "bkt", "k", &data).await;
    let n = data.len();
    let cases: [(&str, std::ops::Range<usize>); 5] = [
        ("bytes=0-9", 0..10),
        ("bytes=1048570-1048600", 1_048_570..1_048_601),
        ("bytes=2097000-", 2_097_000..n),
        ("bytes=-100", n - 100..n),
        ("bytes=5-99999999", 5..n),
    ];
    for (range, want) in cases {
        let out = c.get_object().bucket("bkt").key("k").range(range).send().await?;
        assert_eq!(out.content_range(), Some(format!("bytes {}-{}/{n}", want.start, want.end - 1).as_str()), "{range}");
        assert_eq!(body_of(out).await, &data[want], "{range}");
    }
    for bad in [format!("bytes={n}-"), "bytes=-0".to_string()] {
        let e = c.get_object().bucket("bkt").key("k").range(&bad).send().await.expect_err("416");
        assert_eq!(code(&e), "InvalidRange", "{bad}");
        assert_eq!(status(&e), 416);
    }
    Ok(())
}

async fn conditional_gets_and_heads_answer_304_and_412(c: aws_sdk_s3::Client) -> R {
    c.create_bucket().bucket("bkt").send().await?;
    let etag = put(&c, "bkt", "k", b"hello").await;
    let past = DateTime::from_secs(1_000_000_000);
    let future = DateTime::from_secs(4_000_000_000);

    let ok = c.get_object().bucket("bkt").key("k").if_match(&etag).send().await?;
    assert_eq!(body_of(ok).await, b"hello");
    let e = c.get_object().bucket("bkt").key("k").if_match("\"other\"").send().await.expect_err("412");
    assert_eq!(status(&e), 412);
    let e = c.get_object().bucket("bkt").key("k").if_none_match(&etag).send().await.expect_err("304");
    assert_eq!(status(&e), 304);
    // A 304 carries the validators of the current object (RFC 9110 15.4.5).
    let raw = e.raw_response().expect("raw 304");
    assert_eq!(raw.headers().get("etag"), Some(etag.as_str()));
    let head = c.head_object().bucket("bkt").key("k").send().await?;
    let lm = raw.headers().get("last-modified").expect("Last-Modified on 304");
    let lm = DateTime::from_str(lm, aws_sdk_s3::primitives::DateTimeFormat::HttpDate)?;
    assert_eq!(Some(lm.secs()), head.last_modified().map(|t| t.secs()));
    c.get_object().bucket("bkt").key("k").if_none_match("\"other\"").send().await?;
    let e = c.get_object().bucket("bkt").key("k").if_modified_since(future).send().await.expect_err("304");
    assert_eq!(status(&e), 304);
    c.get_object().bucket("bkt").key("k").if_modified_since(past).send().await?;
    let e = c.get_object().bucket("bkt").key("k").if_unmodified_since(past).send().await.expect_err("412");
    assert_eq!(status(&e), 412);
    c.get_object().bucket("bkt").key("k").if_unmodified_since(future).send().await?;

    let e = c.head_object().bucket("bkt").key("k").if_none_match(&etag).send().await.expect_err("304");
    assert_eq!(status(&e), 304);
    let e = c.head_object().bucket("bkt").key("k").if_match("\"x\"").send().await.expect_err("412");
    assert_eq!(status(&e), 412);
    Ok(())
}

async fn conditional_puts_honour_if_none_match_and_if_match(c: aws_sdk_s3::Client) -> R {
    c.create_bucket().bucket("bkt").send().await?;
    c.put_object().bucket("bkt").key("k").if_none_match("*").body(ByteStream::from_static(b"1")).send().await?;
    let e = c
        .put_object()
        .bucket("bkt")
        .key("k")
        .if_none_match("*")
        .body(ByteStream::from_static(b"2"))
        .send()
        .await
        .expect_err("exists");
    assert_eq!(code(&e), "PreconditionFailed");
    let etag = c.head_object().bucket("bkt").key("k").send().await?.e_tag.expect("etag");
    let e = c
        .put_object()
        .bucket("bkt")
        .key("k")
        .if_match("\"0123\"")
        .body(ByteStream::from_static(b"3"))
        .send()
        .await
        .expect_err("mismatch");
    assert_eq!(code(&e), "PreconditionFailed");
    c.put_object().bucket("bkt").key("k").if_match(&etag).body(ByteStream::from_static(b"4")).send().await?;
    let e = c
        .put_object()
        .bucket("bkt")
        .key("absent")
        .if_match(&etag)
        .body(ByteStream::from_static(b"5"))
        .send()
        .await
        .expect_err("absent");
    assert_eq!(code(&e), "NoSuchKey");
    let out = c.get_object().bucket("bkt").key("k").send().await?;
    assert_eq!(body_of(out).await, b"4");
    Ok(())
}

async fn copies_keep_or_replace_metadata_and_check_source_conditions(c: aws_sdk_s3::Client) -> R {
    c.create_bucket().bucket("src").send().await?;
    c.create_bucket().bucket("dst").send().await?;
    let data = pseudo_random(1_500_000, 3);
    let etag = c
        .put_object()
        .bucket("src")
        .key("a")
        .content_type("text/x-a")
        .metadata("m", "1")
        .body(ByteStream::from(data.clone()))
        .send()
        .await?
        .e_tag
        .expect("etag");
    let r = c.copy_object().bucket("dst").key("b").copy_source("src/a").copy_source_if_match(&etag).send().await?;
    assert_eq!(r.copy_object_result().and_then(|r| r.e_tag()), Some(etag.as_str()));
    let out = c.get_object().bucket("dst").key("b").send().await?;
    assert_eq!(out.content_type(), Some("text/x-a"));
    assert_eq!(out.metadata().and_then(|m| m.get("m")).map(String::as_str), Some("1"));
    assert_eq!(body_of(out).await, data);

    c.copy_object()
        .bucket("dst")
        .key("c")
        .copy_source("src/a")
        .metadata_directive(MetadataDirective::Replace)
        .content_type("text/x-c")
        .metadata("n", "2")
        .send()
        .await?;
    let head = c.head_object().bucket("dst").key("c").send().await?;
    assert_eq!(head.content_type(), Some("text/x-c"));
    assert!(head.metadata().is_some_and(|m| m.get("m").is_none() && m.get("n").is_some()));

    // Each x-amz-copy-source-if-* that does not hold fails the copy with 412.
    for failing in 0..4 {
        let b = c.copy_object().bucket("dst").key("d").copy_source("src/a");
        let b = match failing {
            0 => b.copy_source_if_match("\"nope\""),
            1 => b.copy_source_if_none_match(&etag),
            2 => b.copy_source_if_modified_since(DateTime::from_secs(4_000_000_000)),
            _ => b.copy_source_if_unmodified_since(DateTime::from_secs(1_000_000_000)),
        };
        let e = b.send().await.expect_err("412");
        assert_eq!(code(&e), "PreconditionFailed", "condition {failing}");
    }
    let e = c.copy_object().bucket("src").key("a").copy_source("src/a").send().await.expect_err("self");
    assert_eq!(code(&e), "InvalidRequest");
    let e = c.copy_object().bucket("dst").key("x").copy_source("src/missing").send().await.expect_err("404");
    assert_eq!(code(&e), "NoSuchKey");

    // Deleting the source leaves the copy intact (blocks are shared by reference).
    c.delete_object().bucket("src").key("a").send().await?;
    let out = c.get_object().bucket("dst").key("b").send().await?;
    assert_eq!(body_of(out).await, data);
    Ok(())
}

/// SSE, tagging, storage classes, object lock and versions are not
/// implemented: asking for them gets NotImplemented and stores nothing
/// (an SSE-C PUT used to be stored in plaintext and served without the key).
async fn an_expected_bucket_owner_is_refused_on_bucket_listing_and_upload_operations(c: aws_sdk_s3::Client) -> R {
    // There are no account ids here, so an expected owner can be neither
    // checked nor ignored (the client wants the request to fail on another
    // owner's bucket): every operation that takes one answers NotImplemented.
    const OWNER: &str = "111122223333";
    c.create_bucket().bucket("owned").send().await?;
    put(&c, "owned", "k", b"v").await;
    let e = c.head_bucket().bucket("owned").expected_bucket_owner(OWNER).send().await.expect_err("HeadBucket");
    assert_eq!(status(&e), 501, "HeadBucket: {e:?}");
    let e = c.list_objects_v2().bucket("owned").expected_bucket_owner(OWNER).send().await.expect_err("ListObjectsV2");
    assert_eq!(code(&e), "NotImplemented");
    let e = c.list_objects().bucket("owned").expected_bucket_owner(OWNER).send().await.expect_err("ListObjects");
    assert_eq!(code(&e), "NotImplemented");
    let e = c.get_bucket_location().bucket("owned").expected_bucket_owner(OWNER).send().await.expect_err("location");
    assert_eq!(code(&e), "NotImplemented");
    let e = c.list_multipart_uploads().bucket("owned").expected_bucket_owner(OWNER).send().await.expect_err("uploads");
    assert_eq!(code(&e), "NotImplemented");
    let up = c.create_multipart_upload().bucket("owned").key("m").send().await?;
    let id = up.upload_id().unwrap_or_default();
    let e = c
        .list_parts()
        .bucket("owned")
        .key("m")
        .upload_id(id)
        .expected_bucket_owner(OWNER)
        .send()
        .await
        .expect_err("ListParts");
    assert_eq!(code(&e), "NotImplemented");
    let e = c
        .abort_multipart_upload()
        .bucket("owned")
        .key("m")
        .upload_id(id)
        .expected_bucket_owner(OWNER)
        .send()
        .await
        .expect_err("AbortMultipartUpload");
    assert_eq!(code(&e), "NotImplemented");
    // The refused abort left the upload in place; a plain one removes it.
    let uploads = c.list_multipart_uploads().bucket("owned").send().await?;
    assert_eq!(uploads.uploads().len(), 1, "the refused abort changed nothing");
    c.abort_multipart_upload().bucket("owned").key("m").upload_id(id).send().await?;
    c.delete_object().bucket("owned").key("k").send().await?;
    let e = c.delete_bucket().bucket("owned").expected_bucket_owner(OWNER).send().await.expect_err("DeleteBucket");
    assert_eq!(code(&e), "NotImplemented");
    // The refused delete left the bucket; without the header it goes.
    c.head_bucket().bucket("owned").send().await?;
    c.delete_bucket().bucket("owned").send().await?;
    Ok(())
}

async fn options_we_do_not_implement_are_refused_and_nothing_is_stored(c: aws_sdk_s3::Client) -> R {
    use aws_sdk_s3::types::{ServerSideEncryption, StorageClass};
    c.create_bucket().bucket("bkt").send().await?;
    let key = base64(&[7u8; 32]);
    let key_md5 = base64(&md5::Md5::digest([7u8; 32]));
    // SSE-C is served (sse_c_*), SSE-KMS and SSE-S3 are not, on any write.
    let e = c
        .create_multipart_upload()
        .bucket("bkt")
        .key("secret")
        .server_side_encryption(ServerSideEncryption::AwsKms)
        .send()
        .await
        .expect_err("SSE-KMS multipart");
    assert_eq!(code(&e), "NotImplemented");
    put(&c, "bkt", "copy-source", b"v").await;
    let e = c
        .copy_object()
        .bucket("bkt")
        .key("secret")
        .copy_source("bkt/copy-source")
        .server_side_encryption(ServerSideEncryption::Aes256)
        .send()
        .await
        .expect_err("SSE-S3 copy");
    assert_eq!(code(&e), "NotImplemented");
    c.delete_object().bucket("bkt").key("copy-source").send().await?;
    let e = c
        .put_object()
        .bucket("bkt")
        .key("secret")
        .server_side_encryption(ServerSideEncryption::AwsKms)
        .body(ByteStream::from_static(b"plaintext"))
        .send()
        .await
        .expect_err("SSE-KMS");
    assert_eq!(code(&e), "NotImplemented");
    let e = c
        .put_object()
        .bucket("bkt")
        .key("secret")
        .tagging("a=b")
        .body(ByteStream::from_static(b"plaintext"))
        .send()
        .await
        .expect_err("tagging");
    assert_eq!(code(&e), "NotImplemented");
    let e = c
        .create_multipart_upload()
        .bucket("bkt")
        .key("secret")
        .storage_class(StorageClass::Glacier)
        .send()
        .await
        .expect_err("GLACIER");
    assert_eq!(code(&e), "NotImplemented");
    // Nothing was stored and no upload was left behind.
    let listed = c.list_objects_v2().bucket("bkt").send().await?;
    assert!(listed.contents().is_empty(), "{:?}", listed.contents());
    let uploads = c.list_multipart_uploads().bucket("bkt").send().await?;
    assert!(uploads.uploads().is_empty());

    // What we do implement still works, and a GET naming an SSE-C key (of
    // an object stored without) or a version other than "null" is refused
    // rather than answered with the current plaintext object.
    put(&c, "bkt", "plain", b"v").await;
    c.put_object()
        .bucket("bkt")
        .key("std")
        .storage_class(StorageClass::Standard)
        .acl(aws_sdk_s3::types::ObjectCannedAcl::Private)
        .body(ByteStream::from_static(b"v"))
        .send()
        .await?;
    let e = c
        .get_object()
        .bucket("bkt")
        .key("plain")
        .sse_customer_algorithm("AES256")
        .sse_customer_key(&key)
        .sse_customer_key_md5(&key_md5)
        .send()
        .await
        .expect_err("SSE-C GET");
    assert_eq!(code(&e), "InvalidRequest");
    // (Version ids: see the `versioning` tests; one no server gives is InvalidArgument.)
    let e = c.get_object().bucket("bkt").key("plain").version_id("v2").send().await.expect_err("versionId");
    assert_eq!(code(&e), "InvalidArgument");
    let got = c.get_object().bucket("bkt").key("plain").version_id("null").send().await?;
    assert_eq!(body_of(got).await, b"v");
    let e = c.delete_object().bucket("bkt").key("plain").version_id("v2").send().await.expect_err("delete version");
    assert_eq!(code(&e), "InvalidArgument");
    assert!(c.head_object().bucket("bkt").key("plain").send().await.is_ok(), "a refused delete deleted");
    Ok(())
}

/// DeleteObject with If-Match / x-amz-if-match-size /
/// x-amz-if-match-last-modified-time, and DeleteObjects with per-key ETag
/// and Size: a condition that does not hold keeps the object (412, or a
/// per-key PreconditionFailed), a conditional delete of a missing key is
/// NoSuchKey, and conditions that hold delete.
async fn conditional_deletes_keep_the_object_when_a_condition_fails(c: aws_sdk_s3::Client) -> R {
    c.create_bucket().bucket("bkt").send().await?;
    let etag = put(&c, "bkt", "k", b"four").await;
    let exists = |c: aws_sdk_s3::Client, k: &'static str| async move {
        c.head_object().bucket("bkt").key(k).send().await.is_ok()
    };

    let e = c.delete_object().bucket("bkt").key("k").if_match("\"0123\"").send().await.expect_err("wrong etag");
    assert_eq!(code(&e), "PreconditionFailed");
    let e = c.delete_object().bucket("bkt").key("k").if_match_size(5).send().await.expect_err("wrong size");
    assert_eq!(code(&e), "PreconditionFailed");
    let e = c
        .delete_object()
        .bucket("bkt")
        .key("k")
        .if_match_last_modified_time(DateTime::from_secs(1_000_000))
        .send()
        .await
        .expect_err("wrong time");
    assert_eq!(code(&e), "PreconditionFailed");
    assert!(exists(c.clone(), "k").await, "a failed conditional delete removed the object");
    let e = c.delete_object().bucket("bkt").key("missing").if_match("*").send().await.expect_err("missing");
    assert_eq!(code(&e), "NoSuchKey");

    let head = c.head_object().bucket("bkt").key("k").send().await?;
    c.delete_object()
        .bucket("bkt")
        .key("k")
        .if_match(&etag)
        .if_match_size(4)
        .if_match_last_modified_time(head.last_modified.expect("last-modified"))
        .send()
        .await?;
    assert!(!exists(c.clone(), "k").await);

    // DeleteObjects: per-key conditions, reported per key.
    let e1 = put(&c, "bkt", "a", b"1").await;
    put(&c, "bkt", "b", b"2").await;
    put(&c, "bkt", "s", b"3").await;
    let ids = vec![
        ObjectIdentifier::builder().key("a").e_tag(&e1).build()?,
        ObjectIdentifier::builder().key("b").e_tag("\"0123\"").build()?,
        ObjectIdentifier::builder().key("s").size(99).build()?,
    ];
    let out = c.delete_objects().bucket("bkt").delete(Delete::builder().set_objects(Some(ids)).build()?).send().await?;
    let deleted: Vec<_> = out.deleted().iter().filter_map(|d| d.key()).collect();
    assert_eq!(deleted, ["a"]);
    let mut failed: Vec<_> = out.errors().iter().map(|e| (e.key().unwrap_or(""), e.code().unwrap_or(""))).collect();
    failed.sort();
    assert_eq!(failed, [("b", "PreconditionFailed"), ("s", "PreconditionFailed")]);
    assert!(!exists(c.clone(), "a").await);
    assert!(exists(c.clone(), "b").await && exists(c.clone(), "s").await);
    Ok(())
}

/// max-keys=0 is an empty page that is not truncated; ListBuckets pages by
/// max-buckets and its continuation token; DeleteObjects of more than 1000
/// keys is MalformedXML.
async fn max_keys_zero_and_max_buckets_page_as_s3_does(c: aws_sdk_s3::Client) -> R {
    for b in ["b-one", "b-three", "b-two", "other"] {
        c.create_bucket().bucket(b).send().await?;
    }
    put(&c, "b-one", "k", b"v").await;
    let out = c.list_objects_v2().bucket("b-one").max_keys(0).send().await?;
    assert!(out.contents().is_empty());
    assert_eq!(out.is_truncated(), Some(false));
    let out = c.list_objects().bucket("b-one").max_keys(0).send().await?;
    assert_eq!(out.is_truncated(), Some(false));

    let mut names = Vec::new();
    let mut token = None;
    for _ in 0..5 {
        let page = c.list_buckets().prefix("b-").max_buckets(2).set_continuation_token(token.clone()).send().await?;
        assert!(page.buckets().len() <= 2, "{:?}", page.buckets());
        names.extend(page.buckets().iter().filter_map(|b| b.name().map(str::to_owned)));
        token = page.continuation_token().map(str::to_owned);
        if token.is_none() {
            break;
        }
    }
    assert_eq!(names, ["b-one", "b-three", "b-two"]);
    let e = c.list_buckets().max_buckets(0).send().await.expect_err("max-buckets 0");
    assert_eq!(code(&e), "InvalidArgument");

    for n in [1001, 10_000] {
        let ids =
            (0..n).map(|i| ObjectIdentifier::builder().key(format!("k{i}")).build()).collect::<Result<Vec<_>, _>>()?;
        let e = c
            .delete_objects()
            .bucket("b-one")
            .delete(Delete::builder().set_objects(Some(ids)).build()?)
            .send()
            .await
            .expect_err("over 1000 keys");
        assert_eq!(code(&e), "MalformedXML", "{n} keys");
    }
    assert!(c.head_object().bucket("b-one").key("k").send().await.is_ok());
    Ok(())
}

async fn delete_objects_removes_a_batch_and_reports_each_key(c: aws_sdk_s3::Client) -> R {
    c.create_bucket().bucket("bkt").send().await?;
    for i in 0..5 {
        put(&c, "bkt", &format!("k{i}"), b"v").await;
    }
    let ids = ["k0", "k1", "k2", "never-existed"]
        .iter()
        .map(|k| ObjectIdentifier::builder().key(*k).build())
        .collect::<Result<Vec<_>, _>>()?;
    let out = c.delete_objects().bucket("bkt").delete(Delete::builder().set_objects(Some(ids)).build()?).send().await?;
    assert_eq!(out.deleted().len(), 4);
    assert!(out.errors().is_empty());
    let left: Vec<_> = c
        .list_objects_v2()
        .bucket("bkt")
        .send()
        .await?
        .contents()
        .iter()
        .filter_map(|o| o.key().map(str::to_owned))
        .collect();
    assert_eq!(left, ["k3", "k4"]);
    Ok(())
}

async fn listings_page_through_prefixes_delimiters_and_markers(c: aws_sdk_s3::Client) -> R {
    c.create_bucket().bucket("bkt").send().await?;
    let keys = ["a/1", "a/2", "a/b/3", "b", "c/1", "c/2", "d", "e f/g+h"];
    for k in keys {
        put(&c, "bkt", k, b"x").await;
    }
    // v2 with a delimiter, two entries per page.
    let mut seen = Vec::new();
    let mut token = None;
    for _ in 0..10 {
        let out = c
            .list_objects_v2()
            .bucket("bkt")
            .delimiter("/")
            .max_keys(2)
            .set_continuation_token(token.clone())
            .send()
            .await?;
        seen.extend(out.common_prefixes().iter().filter_map(|p| p.prefix().map(str::to_owned)));
        seen.extend(out.contents().iter().filter_map(|o| o.key().map(str::to_owned)));
        assert!(out.key_count().unwrap_or(0) <= 2);
        if !out.is_truncated().unwrap_or(false) {
            break;
        }
        token = out.next_continuation_token().map(str::to_owned);
    }
    seen.sort();
    assert_eq!(seen, ["a/", "b", "c/", "d", "e f/"]);

    // Prefix plus delimiter, and start-after.
    let out = c.list_objects_v2().bucket("bkt").prefix("a/").delimiter("/").send().await?;
    let ks: Vec<_> = out.contents().iter().filter_map(|o| o.key()).collect();
    assert_eq!(ks, ["a/1", "a/2"]);
    assert_eq!(out.common_prefixes().iter().filter_map(|p| p.prefix()).collect::<Vec<_>>(), ["a/b/"]);
    let out = c.list_objects_v2().bucket("bkt").start_after("c/1").send().await?;
    let ks: Vec<_> = out.contents().iter().filter_map(|o| o.key()).collect();
    assert_eq!(ks, ["c/2", "d", "e f/g+h"]);

    // v1 with markers.
    let mut all = Vec::new();
    let mut marker: Option<String> = None;
    for _ in 0..10 {
        let out = c.list_objects().bucket("bkt").max_keys(3).set_marker(marker.clone()).send().await?;
        all.extend(out.contents().iter().filter_map(|o| o.key().map(str::to_owned)));
        if !out.is_truncated().unwrap_or(false) {
            break;
        }
        marker = out.next_marker().map(str::to_owned).or_else(|| all.last().cloned());
    }
    assert_eq!(all, keys);

    // URL encoding of keys in responses.
    let out = c.list_objects_v2().bucket("bkt").prefix("e").encoding_type(EncodingType::Url).send().await?;
    assert_eq!(out.contents().first().and_then(|o| o.key()), Some("e%20f/g%2Bh"));

    let e =
        c.list_objects_v2().bucket("bkt").continuation_token("!!not a token!!").send().await.expect_err("bad token");
    assert_eq!(code(&e), "InvalidArgument");
    let e = c.list_objects_v2().bucket("nob").send().await.expect_err("no bucket");
    assert_eq!(code(&e), "NoSuchBucket");
    Ok(())
}

async fn multipart_uploads_complete_with_an_s3_style_etag(c: aws_sdk_s3::Client) -> R {
    c.create_bucket().bucket("bkt").send().await?;
    let p1 = pseudo_random(5 * 1024 * 1024, 10);
    let p2 = pseudo_random(1234, 11);
    let src = pseudo_random(3 * 1024 * 1024, 12);
    put(&c, "bkt", "source", &src).await;

    let up = c.create_multipart_upload().bucket("bkt").key("big").content_type("x/y").metadata("a", "b").send().await?;
    let id = up.upload_id().expect("id").to_owned();
    let e1 = c
        .upload_part()
        .bucket("bkt")
        .key("big")
        .upload_id(&id)
        .part_number(1)
        .body(ByteStream::from(p1.clone()))
        .send()
        .await?
        .e_tag
        .expect("e1");
    let e2 = c
        .upload_part()
        .bucket("bkt")
        .key("big")
        .upload_id(&id)
        .part_number(2)
        .body(ByteStream::from(p2.clone()))
        .send()
        .await?
        .e_tag
        .expect("e2");
    let e3 = c
        .upload_part_copy()
        .bucket("bkt")
        .key("big")
        .upload_id(&id)
        .part_number(3)
        .copy_source("bkt/source")
        .copy_source_range("bytes=100-199")
        .send()
        .await?
        .copy_part_result()
        .and_then(|r| r.e_tag().map(str::to_owned))
        .expect("e3");
    // A copy range must lie inside the source; it is not clamped like a GET
    // range. One past the end is InvalidRange (416), other forms InvalidArgument.
    let copy_range = |range: String| {
        c.upload_part_copy()
            .bucket("bkt")
            .key("big")
            .upload_id(&id)
            .part_number(4)
            .copy_source("bkt/source")
            .copy_source_range(range)
            .send()
    };
    let past = format!("bytes=100-{}", src.len());
    let e = copy_range(past.clone()).await.expect_err(&past);
    assert_eq!((code(&e).as_str(), status(&e)), ("InvalidRange", 416), "{past}");
    for bad in ["bytes=100-".to_owned(), "bytes=-10".to_owned()] {
        let e = copy_range(bad.clone()).await.expect_err(&bad);
        assert_eq!(code(&e), "InvalidArgument", "{bad}");
    }
    // Part 2 is too small to be in the middle; reorder so it is last.
    let parts = c.list_parts().bucket("bkt").key("big").upload_id(&id).send().await?;
    assert_eq!(parts.parts().len(), 3);
    assert_eq!(parts.parts()[0].size(), Some(p1.len() as i64));
    let uploads = c.list_multipart_uploads().bucket("bkt").send().await?;
    assert_eq!(uploads.uploads().len(), 1);
    assert_eq!(uploads.uploads()[0].upload_id(), Some(id.as_str()));

    let part = |n: i32, e: &str| CompletedPart::builder().part_number(n).e_tag(e).build();
    // Too small a middle part.
    let e = c
        .complete_multipart_upload()
        .bucket("bkt")
        .key("big")
        .upload_id(&id)
        .multipart_upload(
            CompletedMultipartUpload::builder().parts(part(1, &e1)).parts(part(2, &e2)).parts(part(3, &e3)).build(),
        )
        .send()
        .await
        .expect_err("too small");
    assert_eq!(code(&e), "EntityTooSmall");
    // Wrong ETag.
    let e = c
        .complete_multipart_upload()
        .bucket("bkt")
        .key("big")
        .upload_id(&id)
        .multipart_upload(CompletedMultipartUpload::builder().parts(part(1, "\"beef\"")).build())
        .send()
        .await
        .expect_err("bad etag");
    assert_eq!(code(&e), "InvalidPart");
    // Out of order.
    let e = c
        .complete_multipart_upload()
        .bucket("bkt")
        .key("big")
        .upload_id(&id)
        .multipart_upload(CompletedMultipartUpload::builder().parts(part(3, &e3)).parts(part(1, &e1)).build())
        .send()
        .await
        .expect_err("order");
    assert_eq!(code(&e), "InvalidPartOrder");

    let done = c
        .complete_multipart_upload()
        .bucket("bkt")
        .key("big")
        .upload_id(&id)
        .multipart_upload(CompletedMultipartUpload::builder().parts(part(1, &e1)).parts(part(3, &e3)).build())
        .send()
        .await?;
    let mut md5s = Vec::new();
    md5s.extend(md5::Md5::digest(&p1));
    md5s.extend(md5::Md5::digest(&src[100..200]));
    let want = format!("\"{}-2\"", hex::encode(md5::Md5::digest(&md5s)));
    assert_eq!(done.e_tag(), Some(want.as_str()));

    let out = c.get_object().bucket("bkt").key("big").send().await?;
    assert_eq!(out.content_type(), Some("x/y"));
    let mut expect = p1.clone();
    expect.extend_from_slice(&src[100..200]);
    assert_eq!(body_of(out).await, expect);
    let part2 = c.get_object().bucket("bkt").key("big").part_number(2).send().await?;
    assert_eq!(part2.parts_count(), Some(2));
    assert_eq!(body_of(part2).await, &src[100..200]);
    let e = c.get_object().bucket("bkt").key("big").part_number(3).send().await.expect_err("no part 3");
    assert_eq!(code(&e), "InvalidPart");
    let e = c.head_object().bucket("bkt").key("big").part_number(0).send().await.expect_err("part 0");
    assert_eq!(status(&e), 400);

    let e = c.list_parts().bucket("bkt").key("big").upload_id(&id).send().await.expect_err("gone");
    assert_eq!(code(&e), "NoSuchUpload");

    // Abort frees everything.
    let up = c.create_multipart_upload().bucket("bkt").key("aborted").send().await?;
    let id2 = up.upload_id().expect("id").to_owned();
    c.upload_part()
        .bucket("bkt")
        .key("aborted")
        .upload_id(&id2)
        .part_number(1)
        .body(ByteStream::from(pseudo_random(2_000_000, 13)))
        .send()
        .await?;
    c.abort_multipart_upload().bucket("bkt").key("aborted").upload_id(&id2).send().await?;
    let e = c
        .upload_part()
        .bucket("bkt")
        .key("aborted")
        .upload_id(&id2)
        .part_number(2)
        .body(ByteStream::from_static(b"x"))
        .send()
        .await
        .expect_err("aborted");
    assert_eq!(code(&e), "NoSuchUpload");
    assert!(c.list_multipart_uploads().bucket("bkt").send().await?.uploads().is_empty());
    let e = c.delete_bucket().bucket("bkt").send().await.expect_err("not empty");
    assert_eq!(code(&e), "BucketNotEmpty", "the completed object keeps the bucket");
    Ok(())
}

#[tokio::test]
async fn checksums_are_stored_returned_and_verified() -> R {
    let _gate = crate::gate::shared();
    let s = InProcess::new();
    let c = s.client();
    c.create_bucket().bucket("bkt").send().await?;
    let data = pseudo_random(2_500_000, 20);
    for algo in [
        ChecksumAlgorithm::Crc32,
        ChecksumAlgorithm::Crc32C,
        ChecksumAlgorithm::Crc64Nvme,
        ChecksumAlgorithm::Sha1,
        ChecksumAlgorithm::Sha256,
    ] {
        let key = format!("k-{}", algo.as_str());
        c.put_object()
            .bucket("bkt")
            .key(&key)
            .checksum_algorithm(algo.clone())
            .body(ByteStream::from(data.clone()))
            .send()
            .await?;
        let out = c.get_object().bucket("bkt").key(&key).checksum_mode(ChecksumMode::Enabled).send().await?;
        let returned = [
            out.checksum_crc32(),
            out.checksum_crc32_c(),
            out.checksum_crc64_nvme(),
            out.checksum_sha1(),
            out.checksum_sha256(),
        ];
        assert_eq!(returned.iter().flatten().count(), 1, "{algo:?}");
        assert_eq!(body_of(out).await, data);
    }

    // The SDK's defaults (a CRC, sent as an aws-chunked trailer or a header) are checked and stored.
    put(&c, "bkt", "default", &data).await;
    let head = c.head_object().bucket("bkt").key("default").checksum_mode(ChecksumMode::Enabled).send().await?;
    assert!(head.checksum_crc32().is_some() || head.checksum_crc64_nvme().is_some(), "{head:?}");

    // Wrong header values.
    let e = c
        .put_object()
        .bucket("bkt")
        .key("bad")
        .checksum_crc32("AAAAAA==")
        .body(ByteStream::from(data.clone()))
        .send()
        .await
        .expect_err("crc32");
    assert_eq!(code(&e), "BadDigest");
    let e = c
        .put_object()
        .bucket("bkt")
        .key("bad")
        .checksum_sha256(base64(&[0u8; 32]))
        .body(ByteStream::from(data.clone()))
        .send()
        .await
        .expect_err("sha256");
    assert_eq!(code(&e), "BadDigest");
    let e = c
        .put_object()
        .bucket("bkt")
        .key("bad")
        .content_md5(base64(&md5::Md5::digest(b"other")))
        .body(ByteStream::from(data.clone()))
        .send()
        .await
        .expect_err("md5");
    assert_eq!(code(&e), "BadDigest");
    let e = c
        .put_object()
        .bucket("bkt")
        .key("bad")
        .content_md5("bm90IG1kNQ==")
        .body(ByteStream::from_static(b"x"))
        .send()
        .await
        .expect_err("bad md5");
    assert_eq!(code(&e), "InvalidDigest");
    let e = c
        .put_object()
        .bucket("bkt")
        .key("bad")
        .checksum_crc32("not-base64!")
        .body(ByteStream::from_static(b"x"))
        .send()
        .await
        .expect_err("malformed");
    assert_eq!(code(&e), "InvalidRequest");
    c.put_object()
        .bucket("bkt")
        .key("good-md5")
        .content_md5(base64(&md5::Md5::digest(&data)))
        .body(ByteStream::from(data.clone()))
        .send()
        .await?;
    let e = c.head_object().bucket("bkt").key("bad").send().await.expect_err("never stored");
    assert_eq!(status(&e), 404);

    // Multipart parts too.
    let up = c.create_multipart_upload().bucket("bkt").key("mp").send().await?;
    let id = up.upload_id().expect("id");
    let e = c
        .upload_part()
        .bucket("bkt")
        .key("mp")
        .upload_id(id)
        .part_number(1)
        .checksum_crc32_c("AAAAAA==")
        .body(ByteStream::from_static(b"part"))
        .send()
        .await
        .expect_err("part");
    assert_eq!(code(&e), "BadDigest");
    Ok(())
}

fn base64(raw: &[u8]) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(raw)
}

/// SigV4 parameters for our test keys in us-east-1, signed now.
fn signing_params<'a>(
    identity: &'a aws_smithy_runtime_api::client::identity::Identity,
    settings: aws_sigv4::http_request::SigningSettings,
) -> aws_sigv4::http_request::SigningParams<'a> {
    aws_sigv4::sign::v4::SigningParams::builder()
        .identity(identity)
        .region("us-east-1")
        .name("s3")
        .time(std::time::SystemTime::now())
        .settings(settings)
        .build()
        .expect("params")
        .into()
}

/// Signs a raw aws-chunked PUT with an unsigned-payload trailer, the way
/// current SDKs send uploads, so the trailer value can be chosen.
fn chunked_put(bucket: &str, key: &str, data: &[u8], trailer: &str) -> http::Request<s3s::Body> {
    chunked_put_encoded(bucket, key, data, trailer, "aws-chunked")
}

/// [`chunked_put`] with the given Content-Encoding (which must name aws-chunked).
fn chunked_put_encoded(
    bucket: &str,
    key: &str,
    data: &[u8],
    trailer: &str,
    encoding: &str,
) -> http::Request<s3s::Body> {
    use aws_sigv4::http_request::{PayloadChecksumKind, SignableBody, SignableRequest, SigningSettings, sign};
    let mut body = Vec::new();
    for chunk in data.chunks(64 * 1024) {
        body.extend_from_slice(format!("{:x}\r\n", chunk.len()).as_bytes());
        body.extend_from_slice(chunk);
        body.extend_from_slice(b"\r\n");
    }
    body.extend_from_slice(format!("0\r\nx-amz-checksum-crc32:{trailer}\r\n\r\n").as_bytes());
    let uri = format!("http://localhost:9000/{bucket}/{key}");
    let decoded = data.len().to_string();
    let len = body.len().to_string();
    let headers = [
        ("host", "localhost:9000"),
        ("content-encoding", encoding),
        ("content-length", len.as_str()),
        ("x-amz-decoded-content-length", decoded.as_str()),
        ("x-amz-trailer", "x-amz-checksum-crc32"),
        ("x-amz-sdk-checksum-algorithm", "CRC32"),
    ];
    let identity = aws_credential_types::Credentials::new(AK, SK, None, None, "t").into();
    let mut settings = SigningSettings::default();
    settings.payload_checksum_kind = PayloadChecksumKind::XAmzSha256;
    let params = signing_params(&identity, settings);
    let signable = SignableRequest::new(
        "PUT",
        uri.clone(),
        headers.iter().copied(),
        SignableBody::Precomputed("STREAMING-UNSIGNED-PAYLOAD-TRAILER".into()),
    )
    .expect("signable");
    let (instructions, _) = sign(signable, &params).expect("sign").into_parts();
    let mut req = http::Request::builder().method("PUT").uri(uri);
    for (k, v) in headers {
        req = req.header(k, v);
    }
    let mut req = req.body(s3s::Body::from(body)).expect("request");
    instructions.apply_to_request_http1x(&mut req);
    req
}

async fn aws_chunked_trailing_checksums_are_verified(c: aws_sdk_s3::Client, svc: s3s::service::S3Service) -> R {
    c.create_bucket().bucket("bkt").send().await?;
    let data = pseudo_random(300_000, 30);
    let crc = base64(&crc32(&data));
    let (st, text) = call(&svc, chunked_put("bkt", "good", &data, &crc)).await;
    assert_eq!(st, 200, "{text}");
    let got = body_of(c.get_object().bucket("bkt").key("good").send().await?).await;
    assert_eq!(got, data);

    let wrong = base64(&crc32(b"something else"));
    let (st, text) = call(&svc, chunked_put("bkt", "bad", &data, &wrong)).await;
    assert_eq!(st, 400);
    assert!(text.contains("BadDigest"), "{text:?}");
    let e = c.head_object().bucket("bkt").key("bad").send().await.expect_err("absent");
    assert_eq!(status(&e), 404);

    // aws-chunked is the upload's framing, not the object's encoding: S3
    // stores "gzip" for "gzip, aws-chunked", and nothing for "aws-chunked".
    let (st, text) = call(&svc, chunked_put_encoded("bkt", "gz", &data, &crc, "gzip, aws-chunked")).await;
    assert_eq!(st, 200, "{text}");
    let head = c.head_object().bucket("bkt").key("gz").send().await?;
    assert_eq!(head.content_encoding(), Some("gzip"));
    let got = c.get_object().bucket("bkt").key("gz").send().await?;
    assert_eq!(got.content_encoding(), Some("gzip"));
    let head = c.head_object().bucket("bkt").key("good").send().await?;
    assert_eq!(head.content_encoding(), None);
    Ok(())
}

fn crc32(data: &[u8]) -> [u8; 4] {
    let raw = lightningstor::checksum::ChecksumAlgo::Crc32.digest(data);
    [raw[0], raw[1], raw[2], raw[3]]
}

#[tokio::test]
async fn every_auth_failure_gets_its_s3_error() -> R {
    let _gate = crate::gate::shared();
    let s = InProcess::new();
    s.client().create_bucket().bucket("bkt").send().await?;
    put(&s.client(), "bkt", "k", b"secret data").await;

    let e = s.client_with(AK, "wrong-secret").list_buckets().send().await.expect_err("bad sig");
    assert_eq!(code(&e), "SignatureDoesNotMatch");
    let e = s.client_with("unknown-key", SK).list_buckets().send().await.expect_err("unknown key");
    assert_eq!(code(&e), "InvalidAccessKeyId");

    let anon = http::Request::builder()
        .uri("http://localhost:9000/bkt/k")
        .header("host", "localhost:9000")
        .body(s3s::Body::empty())?;
    let resp = s.raw(anon).await;
    assert_eq!(resp.status(), 403);
    let text = bytes_of(resp).await;
    assert!(String::from_utf8_lossy(&text).contains("AccessDenied"));

    // Presigned URLs work, and a tampered one does not.
    let p = s
        .client()
        .get_object()
        .bucket("bkt")
        .key("k")
        .presigned(PresigningConfig::expires_in(Duration::from_secs(300))?)
        .await?;
    let request = |uri: &str| {
        let mut r = http::Request::builder().method(p.method()).uri(uri);
        for (k, v) in p.headers() {
            r = r.header(k, v);
        }
        r.header("host", "localhost:9000").body(s3s::Body::empty()).expect("req")
    };
    let resp = s.raw(request(p.uri())).await;
    assert_eq!(resp.status(), 200);
    assert_eq!(bytes_of(resp).await.as_slice(), b"secret data");
    let expired = s
        .client()
        .get_object()
        .bucket("bkt")
        .key("k")
        .presigned(
            PresigningConfig::builder()
                .start_time(std::time::SystemTime::now() - Duration::from_secs(3600))
                .expires_in(Duration::from_secs(60))
                .build()?,
        )
        .await?;
    let mut r = http::Request::builder().method(expired.method()).uri(expired.uri());
    for (k, v) in expired.headers() {
        r = r.header(k, v);
    }
    let resp = s.raw(r.header("host", "localhost:9000").body(s3s::Body::empty())?).await;
    assert_eq!(resp.status(), 403);
    assert!(String::from_utf8_lossy(&bytes_of(resp).await).contains("AccessDenied"));
    let tampered = p.uri().replace("/bkt/k", "/bkt/other");
    let resp = s.raw(request(&tampered)).await;
    assert_eq!(resp.status(), 403);
    let text = bytes_of(resp).await;
    assert!(String::from_utf8_lossy(&text).contains("SignatureDoesNotMatch"));
    Ok(())
}

#[tokio::test]
async fn anonymous_mode_accepts_unsigned_requests() -> R {
    let _gate = crate::gate::shared();
    let s = InProcess::with(|c| lightningstor::Config { anonymous: true, ..c });
    let req = http::Request::builder()
        .method("PUT")
        .uri("http://localhost:9000/open")
        .header("host", "localhost:9000")
        .body(s3s::Body::empty())?;
    assert_eq!(s.raw(req).await.status(), 200);
    let req = http::Request::builder()
        .method("PUT")
        .uri("http://localhost:9000/open/k")
        .header("host", "localhost:9000")
        .body(s3s::Body::from(b"hi".to_vec()))?;
    assert_eq!(s.raw(req).await.status(), 200);
    let req = http::Request::builder()
        .uri("http://localhost:9000/open/k")
        .header("host", "localhost:9000")
        .body(s3s::Body::empty())?;
    let resp = s.raw(req).await;
    assert_eq!(bytes_of(resp).await.as_slice(), b"hi");
    Ok(())
}

#[tokio::test]
async fn virtual_hosted_style_requests_name_the_bucket_in_the_host() -> R {
    let _gate = crate::gate::shared();
    let s = InProcess::new();
    let conf = sdk_config("http://localhost:9000", AK, SK)
        .force_path_style(false)
        .http_client(testkit::sdk::InProcess::from(s.service.clone()))
        .build();
    let c = aws_sdk_s3::Client::from_conf(conf);
    c.create_bucket().bucket("vhost").send().await?;
    put(&c, "vhost", "dir/k", b"via host").await;
    let out = c.get_object().bucket("vhost").key("dir/k").send().await?;
    assert_eq!(body_of(out).await, b"via host");
    // And the same object path style.
    let out = s.client().get_object().bucket("vhost").key("dir/k").send().await?;
    assert_eq!(body_of(out).await, b"via host");
    Ok(())
}

#[tokio::test]
async fn the_spawned_binary_serves_the_sdk_and_metrics_over_http() -> R {
    let _gate = crate::gate::shared();
    let dir = tempfile::tempdir()?;
    let server = Spawned::start(dir.path(), &[]);
    let c = server.client();
    c.create_bucket().bucket("bkt").send().await?;
    let data = pseudo_random(4 * 1024 * 1024 + 5, 40);
    let etag = put(&c, "bkt", "k", &data).await;
    let out = c.get_object().bucket("bkt").key("k").send().await?;
    assert_eq!(out.e_tag(), Some(etag.as_str()));
    assert_eq!(body_of(out).await, data);
    let out = c.get_object().bucket("bkt").key("k").range("bytes=-10").send().await?;
    assert_eq!(body_of(out).await, &data[data.len() - 10..]);
    let e = server_client_bad(&server).list_buckets().send().await.expect_err("bad");
    assert_eq!(code(&e), "SignatureDoesNotMatch");

    let metrics = reqwest::get(format!("{}/metrics", server.endpoint())).await?.text().await?;
    assert!(metrics.contains("lightningstor_objects 1"), "{metrics}");
    assert!(metrics.contains("lightningstor_requests_total"));
    server.stop();

    // Data survives a clean restart.
    let server = Spawned::start(dir.path(), &[]);
    let out = server.client().get_object().bucket("bkt").key("k").send().await?;
    assert_eq!(body_of(out).await, data);
    Ok(())
}

fn server_client_bad(s: &Spawned) -> aws_sdk_s3::Client {
    aws_sdk_s3::Client::from_conf(sdk_config(&s.endpoint(), AK, "bad-secret").build())
}

#[test]
fn the_binary_refuses_to_start_without_keys_unless_anonymous() {
    let _gate = crate::gate::shared();
    let dir = tempfile::tempdir().expect("tempdir");
    let out = std::process::Command::new(binary())
        .args(["serve", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(dir.path())
        .env_remove("LIGHTNINGSTOR_ACCESS_KEY")
        .env_remove("LIGHTNINGSTOR_SECRET_KEY")
        .output()
        .expect("run");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--anonymous"));

    let cfg = dir.path().join("bad.toml");
    std::fs::write(&cfg, "data_dir = \"/tmp/x\"\nunknown_field = 1\n").expect("write");
    let out = std::process::Command::new(binary()).args(["serve", "--config"]).arg(&cfg).output().expect("run");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown_field"));

    let out = std::process::Command::new(binary()).args(["serve", "--help"]).output().expect("help");
    let help = String::from_utf8_lossy(&out.stdout);
    for flag in ["--data-dir", "--listen", "--access-key", "--secret-key", "--anonymous", "--config"] {
        assert!(help.contains(flag), "{flag} missing from --help");
    }
}

#[test]
fn bad_config_files_are_refused_naming_the_file_the_line_and_the_field() {
    let _gate = crate::gate::shared();
    let dir = tempfile::tempdir().expect("tempdir");
    let run = |args: &[&str], file: &std::path::Path| {
        let out = std::process::Command::new(binary()).args(args).arg(file).output().expect("run");
        (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    let write = |name: &str, text: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, text).expect("write");
        p
    };
    for args in [&["serve", "--config"][..], &["cluster", "status", "--config"][..]] {
        let missing = dir.path().join("missing.toml");
        let (code, err) = run(args, &missing);
        assert_eq!(code, Some(1), "{args:?}: {err}");
        assert!(err.contains(&format!("cannot read {}", missing.display())), "{args:?}: {err}");

        let syntax = write("syntax.toml", "data_dir = \"/tmp/x\"\nanonymous = yes\n");
        let (code, err) = run(args, &syntax);
        assert_eq!(code, Some(1), "{args:?}: {err}");
        assert!(err.contains(&format!("{}:2:", syntax.display())), "{args:?}: path and line: {err}");
    }
    let unknown = write("unknown.toml", "data_dir = \"/tmp/x\"\nanonymous = true\n  blocksize = 4096\n");
    let (code, err) = run(&["serve", "--config"], &unknown);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains(&format!("{}:3:3: unknown field `blocksize`", unknown.display())), "{err}");

    // A cluster file is the whole configuration: it is validated on load,
    // and the rule it breaks comes with its path.
    let empty = write("empty.toml", "layout_version = 1\nnodes = []\n");
    let (code, err) = run(&["cluster", "status", "--config"], &empty);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains(&format!("{}: invalid configuration: a cluster needs at least one node", empty.display())),
        "{err}"
    );
}

#[test]
fn flags_that_a_cluster_node_takes_from_its_cluster_file_are_refused_with_node() {
    let _gate = crate::gate::shared();
    // `serve --node` reads the node's addresses, data directory, domains and
    // region from the cluster file; a flag for one of them would be ignored,
    // so it is refused before anything is read or started.
    let dir = tempfile::tempdir().expect("tempdir");
    let missing = dir.path().join("cluster.toml");
    for (flag, value) in
        [("--listen", "127.0.0.1:1"), ("--data-dir", "/tmp/x"), ("--domain", "example.com"), ("--region", "eu-west-1")]
    {
        let out = std::process::Command::new(binary())
            .args(["serve", "--config"])
            .arg(&missing)
            .args(["--node", "n1", flag, value])
            .output()
            .expect("run");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{flag}: {err}");
        assert!(err.contains("cannot be used with"), "{flag}: {err}");
        assert!(err.contains(flag), "{flag}: the message names the flag: {err}");
    }
    // The flags that do apply to a node are still taken.
    let out = std::process::Command::new(binary())
        .args(["serve", "--config"])
        .arg(&missing)
        .args(["--node", "n1", "--anonymous"])
        .output()
        .expect("run");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains(&format!("cannot read {}", missing.display())), "{err}");
}

#[tokio::test]
async fn a_block_corrupted_on_disk_fails_the_get_instead_of_returning_bad_bytes() -> R {
    let _gate = crate::gate::shared();
    let s = InProcess::new();
    let c = s.client();
    c.create_bucket().bucket("bkt").send().await?;
    let data = pseudo_random(3 * 1024 * 1024, 50);
    put(&c, "bkt", "k", &data).await;
    let files = block_files(s.dir.path());
    assert_eq!(files.len(), 3);
    for f in &files {
        let mut raw = std::fs::read(f)?;
        raw[1000] ^= 0x40;
        std::fs::write(f, raw)?;
    }
    let result = match c.get_object().bucket("bkt").key("k").send().await {
        Ok(out) => out.body.collect().await.map(|b| b.into_bytes().to_vec()).ok(),
        Err(_) => None,
    };
    assert!(result.is_none(), "a corrupt object was served");
    let metrics = s.store.metrics.render(&[]);
    assert!(!metrics.contains("lightningstor_corrupt_blocks_total 0"), "{metrics}");
    Ok(())
}

async fn multipart_uploads_are_listed_by_prefix_and_page_by_markers(c: aws_sdk_s3::Client) -> R {
    c.create_bucket().bucket("bkt").send().await?;
    let mut ids = Vec::new();
    for key in ["a/1", "a/2", "b/1", "c"] {
        let up = c.create_multipart_upload().bucket("bkt").key(key).send().await?;
        ids.push(up.upload_id().expect("id").to_owned());
    }
    let out = c.list_multipart_uploads().bucket("bkt").prefix("a/").send().await?;
    let keys: Vec<_> = out.uploads().iter().filter_map(|u| u.key()).collect();
    assert_eq!(keys, ["a/1", "a/2"]);
    let out = c.list_multipart_uploads().bucket("bkt").delimiter("/").send().await?;
    let keys: Vec<_> = out.uploads().iter().filter_map(|u| u.key()).collect();
    assert_eq!(keys, ["c"]);
    let prefixes: Vec<_> = out.common_prefixes().iter().filter_map(|p| p.prefix()).collect();
    assert_eq!(prefixes, ["a/", "b/"]);
    let mut seen = Vec::new();
    let (mut km, mut um) = (None::<String>, None::<String>);
    for _ in 0..10 {
        let out = c
            .list_multipart_uploads()
            .bucket("bkt")
            .max_uploads(1)
            .set_key_marker(km.clone())
            .set_upload_id_marker(um.clone())
            .send()
            .await?;
        seen.extend(out.uploads().iter().filter_map(|u| u.key().map(str::to_owned)));
        if !out.is_truncated().unwrap_or(false) {
            break;
        }
        km = out.next_key_marker().map(str::to_owned);
        um = out.next_upload_id_marker().map(str::to_owned);
    }
    assert_eq!(seen, ["a/1", "a/2", "b/1", "c"]);
    Ok(())
}

/// A SigV4-signed request built by hand, so the signed payload hash or the
/// presigned lifetime can be chosen. `presign` signs into the query string
/// with that lifetime.
fn signed(
    method: &str,
    path: &str,
    body: &[u8],
    payload_sha256: &str,
    presign: Option<Duration>,
) -> http::Request<s3s::Body> {
    use aws_sigv4::http_request::{SignableBody, SignableRequest, SignatureLocation, SigningSettings, sign};
    let uri = format!("http://localhost:9000{path}");
    let len = body.len().to_string();
    let mut headers = vec![("host", "localhost:9000")];
    if presign.is_none() {
        headers.push(("content-length", len.as_str()));
        headers.push(("x-amz-content-sha256", payload_sha256));
    }
    let identity = aws_credential_types::Credentials::new(AK, SK, None, None, "t").into();
    let mut settings = SigningSettings::default();
    if let Some(d) = presign {
        settings.signature_location = SignatureLocation::QueryParams;
        settings.expires_in = Some(d);
    }
    let params = signing_params(&identity, settings);
    let signable_body = if presign.is_some() {
        SignableBody::UnsignedPayload
    } else {
        SignableBody::Precomputed(payload_sha256.to_owned())
    };
    let signable = SignableRequest::new(method, uri.clone(), headers.iter().copied(), signable_body).expect("signable");
    let (instructions, _) = sign(signable, &params).expect("sign").into_parts();
    let mut req = http::Request::builder().method(method).uri(uri);
    for (k, v) in &headers {
        req = req.header(*k, *v);
    }
    let mut req = req.body(s3s::Body::from(body.to_vec())).expect("request");
    instructions.apply_to_request_http1x(&mut req);
    req
}

async fn call(svc: &s3s::service::S3Service, req: http::Request<s3s::Body>) -> (u16, String) {
    let resp = svc.call(req).await.expect("service");
    let status = resp.status().as_u16();
    (status, String::from_utf8_lossy(&bytes_of(resp).await).into_owned())
}

async fn a_body_that_does_not_match_its_signed_sha256_is_refused_and_not_stored(
    c: aws_sdk_s3::Client,
    svc: s3s::service::S3Service,
) -> R {
    use sha2::Digest as _;
    c.create_bucket().bucket("sha").send().await?;
    let signed_for = hex::encode(sha2::Sha256::digest(b"hello"));
    // Same length, other bytes: only the hash tells them apart.
    let (status, text) = call(&svc, signed("PUT", "/sha/k", b"world", &signed_for, None)).await;
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("XAmzContentSHA256Mismatch"), "{text}");
    let e = c.get_object().bucket("sha").key("k").send().await.expect_err("nothing stored");
    assert_eq!(code(&e), "NoSuchKey");
    // The matching body is stored.
    let (status, text) = call(&svc, signed("PUT", "/sha/k", b"hello", &signed_for, None)).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(body_of(c.get_object().bucket("sha").key("k").send().await?).await, b"hello");
    Ok(())
}

async fn presigned_urls_valid_for_more_than_seven_days_are_refused(
    c: aws_sdk_s3::Client,
    svc: s3s::service::S3Service,
) -> R {
    c.create_bucket().bucket("pre").send().await?;
    put(&c, "pre", "k", b"presigned").await;
    let week = Duration::from_secs(7 * 24 * 3600);
    let (status, text) = call(&svc, signed("GET", "/pre/k", b"", "", Some(week))).await;
    assert_eq!((status, text.as_str()), (200, "presigned"), "a URL valid for exactly seven days works");
    let (status, text) = call(&svc, signed("GET", "/pre/k", b"", "", Some(week + Duration::from_secs(1)))).await;
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("AuthorizationQueryParametersError"), "{text}");
    Ok(())
}

/// The `response-*` query overrides of GetObject and HeadObject replace the
/// stored standard headers in the answer (and only there: the object keeps
/// its own, as a plain GET shows).
async fn gets_and_heads_honour_every_response_header_override(c: aws_sdk_s3::Client) -> R {
    c.create_bucket().bucket("over").send().await?;
    c.put_object()
        .bucket("over")
        .key("k")
        .content_type("text/plain")
        .content_language("en")
        .cache_control("no-cache")
        .content_disposition("inline")
        .content_encoding("identity")
        .expires(DateTime::from_secs(1_700_000_000))
        .body(ByteStream::from_static(b"body"))
        .send()
        .await?;
    let when = DateTime::from_secs(1_800_000_000);
    let http_date = "Fri, 15 Jan 2027 08:00:00 GMT";
    assert_eq!(when.fmt(aws_sdk_s3::primitives::DateTimeFormat::HttpDate)?, http_date);
    let want = ["image/png", "fr", "max-age=60", "attachment; filename=\"x.png\"", "gzip", http_date];
    let g = c
        .get_object()
        .bucket("over")
        .key("k")
        .response_content_type(want[0])
        .response_content_language(want[1])
        .response_cache_control(want[2])
        .response_content_disposition(want[3])
        .response_content_encoding(want[4])
        .response_expires(when)
        .send()
        .await?;
    let got = [
        g.content_type(),
        g.content_language(),
        g.cache_control(),
        g.content_disposition(),
        g.content_encoding(),
        g.expires_string(),
    ];
    assert_eq!(got, want.map(Some), "GET");
    let h = c
        .head_object()
        .bucket("over")
        .key("k")
        .response_content_type(want[0])
        .response_content_language(want[1])
        .response_cache_control(want[2])
        .response_content_disposition(want[3])
        .response_content_encoding(want[4])
        .response_expires(when)
        .send()
        .await?;
    let got = [
        h.content_type(),
        h.content_language(),
        h.cache_control(),
        h.content_disposition(),
        h.content_encoding(),
        h.expires_string(),
    ];
    assert_eq!(got, want.map(Some), "HEAD");
    let h = c.head_object().bucket("over").key("k").send().await?;
    let stored = ["text/plain", "en", "no-cache", "inline", "identity", "Tue, 14 Nov 2023 22:13:20 GMT"];
    let got = [
        h.content_type(),
        h.content_language(),
        h.cache_control(),
        h.content_disposition(),
        h.content_encoding(),
        h.expires_string(),
    ];
    assert_eq!(got, stored.map(Some), "plain HEAD");
    Ok(())
}

/// CopyObject with `x-amz-checksum-algorithm`: the copy gets that checksum
/// of its bytes (computed, or the source's own of that algorithm), returned
/// in the answer and stored with it, as PutObject does with the header.
async fn a_copy_asking_for_a_checksum_algorithm_stores_and_returns_that_checksum(c: aws_sdk_s3::Client) -> R {
    use base64::Engine as _;
    use sha2::Digest as _;
    c.create_bucket().bucket("sums").send().await?;
    let data = pseudo_random(300_000, 61);
    let src = c
        .put_object()
        .bucket("sums")
        .key("src")
        .checksum_algorithm(ChecksumAlgorithm::Crc32)
        .body(ByteStream::from(data.clone()))
        .send()
        .await?;
    let crc32 = src.checksum_crc32().expect("the source's CRC32").to_owned();
    let sha256 = base64::engine::general_purpose::STANDARD.encode(sha2::Sha256::digest(&data));
    let copy = |key: &'static str, algo: ChecksumAlgorithm| {
        c.copy_object().bucket("sums").key(key).copy_source("sums/src").checksum_algorithm(algo).send()
    };
    let out = copy("sha", ChecksumAlgorithm::Sha256).await?;
    let r = out.copy_object_result().expect("result");
    assert_eq!((r.checksum_sha256(), r.checksum_crc32()), (Some(sha256.as_str()), None));
    let got = c.get_object().bucket("sums").key("sha").checksum_mode(ChecksumMode::Enabled).send().await?;
    assert_eq!(got.checksum_sha256(), Some(sha256.as_str()));
    assert_eq!(body_of(got).await, data);
    // The algorithm the source has: its checksum, unchanged.
    let out = copy("crc", ChecksumAlgorithm::Crc32).await?;
    assert_eq!(out.copy_object_result().and_then(|r| r.checksum_crc32()), Some(crc32.as_str()));
    let head = c.head_object().bucket("sums").key("crc").checksum_mode(ChecksumMode::Enabled).send().await?;
    assert_eq!(head.checksum_crc32(), Some(crc32.as_str()));
    Ok(())
}

async fn a_complete_into_a_bucket_deleted_meanwhile_fails_with_no_such_bucket(c: aws_sdk_s3::Client) -> R {
    c.create_bucket().bucket("going").send().await?;
    let id = c.create_multipart_upload().bucket("going").key("k").send().await?.upload_id.expect("upload id");
    let p = c.upload_part().bucket("going").key("k").upload_id(&id).part_number(1).body(ByteStream::from_static(b"x"));
    let part = CompletedPart::builder().part_number(1).e_tag(p.send().await?.e_tag.expect("etag")).build();
    // Uploads in progress do not keep a bucket; they go with it.
    c.delete_bucket().bucket("going").send().await?;
    let e = c
        .complete_multipart_upload()
        .bucket("going")
        .key("k")
        .upload_id(&id)
        .multipart_upload(CompletedMultipartUpload::builder().parts(part).build())
        .send()
        .await
        .expect_err("the bucket is gone");
    assert_eq!(code(&e), "NoSuchBucket");
    assert_eq!(status(&c.head_bucket().bucket("going").send().await.expect_err("not recreated")), 404);
    let e = c.get_object().bucket("going").key("k").send().await.expect_err("no object");
    assert_eq!(code(&e), "NoSuchBucket");
    Ok(())
}

async fn a_repeated_complete_multipart_upload_gets_the_same_answer(c: aws_sdk_s3::Client) -> R {
    use aws_sdk_s3::types::{CompletedMultipartUpload, CompletedPart};
    c.create_bucket().bucket("again").send().await?;
    let up = c.create_multipart_upload().bucket("again").key("k").send().await?;
    let id = up.upload_id().expect("upload id").to_owned();
    let first = vec![7u8; 5 << 20];
    let mut parts = Vec::new();
    for (n, data) in [(1, first), (2, b"tail".to_vec())] {
        let p = c
            .upload_part()
            .bucket("again")
            .key("k")
            .upload_id(&id)
            .part_number(n)
            .body(ByteStream::from(data))
            .send()
            .await?;
        parts.push(CompletedPart::builder().part_number(n).e_tag(p.e_tag().expect("etag")).build());
    }
    let complete = |parts: Vec<CompletedPart>| {
        c.complete_multipart_upload()
            .bucket("again")
            .key("k")
            .upload_id(&id)
            .multipart_upload(CompletedMultipartUpload::builder().set_parts(Some(parts)).build())
            .send()
    };
    let done = complete(parts.clone()).await?;
    // The SDK retrying after a lost reply: the same answer, the object unchanged.
    let again = complete(parts.clone()).await?;
    assert_eq!(again.e_tag(), done.e_tag());
    assert!(done.e_tag().is_some_and(|t| t.ends_with("-2\"")), "{:?}", done.e_tag());
    let got = c.get_object().bucket("again").key("k").send().await?;
    assert_eq!(got.e_tag(), done.e_tag());
    assert_eq!(got.content_length(), Some((5 << 20) + 4));
    // Another list of parts was not what completed: still NoSuchUpload.
    let e = complete(parts[..1].to_vec()).await.expect_err("a different completion");
    assert_eq!(code(&e), "NoSuchUpload");
    // Once the key holds another object, the old upload is gone for good.
    put(&c, "again", "k", b"newer").await;
    let e = complete(parts).await.expect_err("key overwritten");
    assert_eq!(code(&e), "NoSuchUpload");
    let got = body_of(c.get_object().bucket("again").key("k").send().await?).await;
    assert_eq!(got, b"newer", "a retry overwrote a newer object");
    // A conditional complete repeated: the same answer, not 412 for the object it made itself.
    let id = c.create_multipart_upload().bucket("again").key("new").send().await?.upload_id.expect("upload id");
    let p =
        c.upload_part().bucket("again").key("new").upload_id(&id).part_number(1).body(ByteStream::from_static(b"x"));
    let part = CompletedPart::builder().part_number(1).e_tag(p.send().await?.e_tag.expect("etag")).build();
    let complete_new = || {
        c.complete_multipart_upload()
            .bucket("again")
            .key("new")
            .upload_id(&id)
            .if_none_match("*")
            .multipart_upload(CompletedMultipartUpload::builder().parts(part.clone()).build())
            .send()
    };
    let done = complete_new().await?;
    assert_eq!(complete_new().await?.e_tag(), done.e_tag());
    Ok(())
}

async fn a_complete_claiming_a_wrong_object_checksum_is_refused_and_the_upload_stays(c: aws_sdk_s3::Client) -> R {
    use aws_sdk_s3::types::{ChecksumAlgorithm, CompletedMultipartUpload, CompletedPart};
    use base64::Engine as _;
    use sha2::Digest as _;
    let b64 = base64::engine::general_purpose::STANDARD;
    c.create_bucket().bucket("sums").send().await?;
    let up = c
        .create_multipart_upload()
        .bucket("sums")
        .key("k")
        .checksum_algorithm(ChecksumAlgorithm::Sha256)
        .send()
        .await?;
    let id = up.upload_id().expect("upload id").to_owned();
    let mut parts = Vec::new();
    let mut digests = sha2::Sha256::new();
    for (n, data) in [(1, vec![3u8; 5 << 20]), (2, b"end".to_vec())] {
        let p = c
            .upload_part()
            .bucket("sums")
            .key("k")
            .upload_id(&id)
            .part_number(n)
            .checksum_algorithm(ChecksumAlgorithm::Sha256)
            .body(ByteStream::from(data))
            .send()
            .await?;
        let sum = p.checksum_sha256().expect("part checksum").to_owned();
        digests.update(b64.decode(&sum)?);
        parts
            .push(CompletedPart::builder().part_number(n).e_tag(p.e_tag().expect("etag")).checksum_sha256(sum).build());
    }
    let right = format!("{}-2", b64.encode(digests.finalize()));
    let complete = |claim: &str| {
        c.complete_multipart_upload()
            .bucket("sums")
            .key("k")
            .upload_id(&id)
            .checksum_sha256(claim)
            .multipart_upload(CompletedMultipartUpload::builder().set_parts(Some(parts.clone())).build())
            .send()
    };
    let wrong = format!("{}-2", b64.encode([0u8; 32]));
    let e = complete(&wrong).await.expect_err("a wrong object checksum");
    assert_eq!(code(&e), "BadDigest");
    let e = complete(&right.replace("-2", "-3")).await.expect_err("a wrong part count");
    assert_eq!(code(&e), "BadDigest");
    // Nothing was committed and the upload is still there.
    let e = c.head_object().bucket("sums").key("k").send().await.expect_err("no object yet");
    assert_eq!(status(&e), 404);
    c.list_parts().bucket("sums").key("k").upload_id(&id).send().await?;
    let done = complete(&right).await?;
    assert_eq!(done.checksum_sha256(), Some(right.as_str()));
    // A checksum of another algorithm than the upload's is refused.
    let up2 = c.create_multipart_upload().bucket("sums").key("k2").send().await?;
    let id2 = up2.upload_id().expect("upload id");
    let p = c
        .upload_part()
        .bucket("sums")
        .key("k2")
        .upload_id(id2)
        .part_number(1)
        .body(ByteStream::from_static(b"x"))
        .send()
        .await?;
    let e = c
        .complete_multipart_upload()
        .bucket("sums")
        .key("k2")
        .upload_id(id2)
        .checksum_sha256(&right)
        .multipart_upload(
            CompletedMultipartUpload::builder()
                .parts(CompletedPart::builder().part_number(1).e_tag(p.e_tag().expect("etag")).build())
                .build(),
        )
        .send()
        .await
        .expect_err("no checksum algorithm on this upload");
    assert_eq!(code(&e), "InvalidRequest");
    Ok(())
}

/// Raw HTTP/1.1 over TCP: what the server sends back until it closes or
/// `within` passes (the limit is what is asserted by the caller).
fn read_reply(s: &mut std::net::TcpStream, within: Duration) -> (String, bool) {
    use std::io::Read;
    s.set_read_timeout(Some(within)).expect("timeout");
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let closed = loop {
        match s.read(&mut buf) {
            Ok(0) => break true,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if matches!(e.kind(), std::io::ErrorKind::ConnectionReset) => break true,
            Err(_) => break false,
        }
    };
    (String::from_utf8_lossy(&got).into_owned(), closed)
}

/// The path and query of a presigned PUT (its body is not signed, so the
/// server reads it as it comes: what a slow uploader looks like).
async fn presigned_put_target(c: &aws_sdk_s3::Client, bucket: &str, key: &str) -> String {
    let p = c
        .put_object()
        .bucket(bucket)
        .key(key)
        .presigned(PresigningConfig::expires_in(Duration::from_secs(300)).expect("config"))
        .await
        .expect("presign");
    let uri: http::Uri = p.uri().parse().expect("uri");
    uri.path_and_query().expect("path").to_string()
}

/// The HTTP front end's limits, the same for a single node and a cluster
/// (both are served by `server::serve_with_limits`): a header that stalls
/// and a body that stalls end their connection after their timeouts, nothing
/// of the stalled PUT is stored, a PUT declaring more than 5 GiB is refused
/// with EntityTooLarge before its body is sent, `Expect: 100-continue` gets
/// its interim answer, and a normal client is served all along.
async fn slow_and_oversized_requests_are_cut_off_while_others_are_served(svc: s3s::service::S3Service) -> R {
    use std::io::Write;
    let limits = lightningstor::server::Limits {
        header_timeout: Duration::from_secs(1),
        body_idle_timeout: Duration::from_secs(1),
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let metrics: lightningstor::server::MetricsFn = std::sync::Arc::new(String::new);
    let running = lightningstor::server::serve_with_limits(listener, svc, metrics, None, limits)?;
    let addr = running.addr;
    let c = aws_sdk_s3::Client::from_conf(sdk_config(&format!("http://{addr}"), AK, SK).build());
    c.create_bucket().bucket("slow").send().await?;
    let host = format!("Host: {addr}\r\n");

    // A header that never ends, and a presigned PUT whose body stops after 10 of 100 bytes.
    let mut header_stall = std::net::TcpStream::connect(addr)?;
    header_stall.write_all(format!("PUT /slow/a HTTP/1.1\r\n{host}x-partial: ").as_bytes())?;
    let target = presigned_put_target(&c, "slow", "stalled").await;
    let mut body_stall = std::net::TcpStream::connect(addr)?;
    body_stall.write_all(format!("PUT {target} HTTP/1.1\r\n{host}Content-Length: 100\r\n\r\n0123456789").as_bytes())?;

    // Meanwhile a normal client is served.
    put(&c, "slow", "ok", b"served").await;

    let started = std::time::Instant::now();
    let (h, b) = tokio::task::spawn_blocking(move || {
        (read_reply(&mut header_stall, Duration::from_secs(10)), read_reply(&mut body_stall, Duration::from_secs(10)))
    })
    .await?;
    assert!(h.1, "a stalled header keeps its connection open past 10 s: {:?}", h.0);
    assert!(b.1 || !b.0.starts_with("HTTP/1.1 200"), "a stalled body was accepted: {:?}", b.0);
    assert!(b.1, "a stalled body keeps its connection open past 10 s: {:?}", b.0);
    assert!(started.elapsed() < Duration::from_secs(8), "cut off after {:?}", started.elapsed());
    let gone = c.head_object().bucket("slow").key("stalled").send().await;
    assert!(gone.is_err(), "nothing of the stalled PUT may be stored");

    // 6 GB declared: refused before the body, and the connection closed.
    let mut big = std::net::TcpStream::connect(addr)?;
    big.write_all(format!("PUT /slow/big HTTP/1.1\r\n{host}Content-Length: 6000000000\r\n\r\n").as_bytes())?;
    let (text, closed) = tokio::task::spawn_blocking(move || read_reply(&mut big, Duration::from_secs(10))).await?;
    assert!(text.starts_with("HTTP/1.1 400"), "{text}");
    assert!(text.contains("<Code>EntityTooLarge</Code>") && text.contains("<ProposedSize>6000000000<"), "{text}");
    // Answered before s3s, it still names its request, in the header and the XML alike.
    let id = text
        .lines()
        .find_map(|l| l.split_once(':').filter(|(k, _)| k.eq_ignore_ascii_case("x-amz-request-id")))
        .map(|(_, v)| v.trim().to_owned())
        .expect("x-amz-request-id on EntityTooLarge");
    assert!(text.contains(&format!("<RequestId>{id}</RequestId>")), "{text}");
    assert!(closed, "the unread body must not be taken for the next request");

    // Expect: 100-continue gets "100 Continue" before the body is sent.
    let target = presigned_put_target(&c, "slow", "continued").await;
    let mut s = std::net::TcpStream::connect(addr)?;
    s.write_all(
        format!("PUT {target} HTTP/1.1\r\n{host}Content-Length: 5\r\nExpect: 100-continue\r\n\r\n").as_bytes(),
    )?;
    let (interim, s) = tokio::task::spawn_blocking(move || {
        use std::io::Read;
        s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
        let mut buf = [0u8; 64];
        let n = s.read(&mut buf).unwrap_or(0);
        (String::from_utf8_lossy(&buf[..n]).into_owned(), s)
    })
    .await?;
    assert!(interim.starts_with("HTTP/1.1 100 Continue"), "{interim:?}");
    let mut s = s;
    s.write_all(b"hello")?;
    let mut line = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(&mut s), &mut line)?;
    assert!(line.starts_with("HTTP/1.1 200"), "{line}");
    let out = c.get_object().bucket("slow").key("continued").send().await?;
    assert_eq!(body_of(out).await, b"hello");
    assert_eq!(body_of(c.get_object().bucket("slow").key("ok").send().await?).await, b"served");
    running.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_and_oversized_requests_single_node() -> R {
    let _gate = crate::gate::shared();
    let s = InProcess::new();
    slow_and_oversized_requests_are_cut_off_while_others_are_served(s.service.clone()).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_and_oversized_requests_three_node_cluster() -> R {
    let _gate = crate::gate::shared();
    let s = InCluster::new(3);
    let svc = s.service();
    slow_and_oversized_requests_are_cut_off_while_others_are_served(svc).await
}

/// Every reply names its request in `x-amz-request-id` (16 hex digits, a
/// new one per request), and an error's XML body carries the same id as
/// `<RequestId>`, as S3 answers.
async fn replies_carry_a_request_id_and_error_xml_repeats_it(c: aws_sdk_s3::Client) -> R {
    use aws_sdk_s3::operation::RequestId as _;
    let is_id = |s: &str| s.len() == 16 && s.bytes().all(|b| b.is_ascii_hexdigit());
    c.create_bucket().bucket("bkt").send().await?;
    let a = c.put_object().bucket("bkt").key("k").body(ByteStream::from_static(b"v")).send().await?;
    let b = c.head_object().bucket("bkt").key("k").send().await?;
    let (a, b) = (a.request_id().expect("id on PUT"), b.request_id().expect("id on HEAD"));
    assert!(is_id(a) && is_id(b), "{a} {b}");
    assert_ne!(a, b, "two requests share an id");

    let e = c.get_object().bucket("bkt").key("missing").send().await.expect_err("missing");
    let raw = e.raw_response().expect("raw reply");
    let id = raw.headers().get("x-amz-request-id").expect("x-amz-request-id on an error").to_owned();
    assert!(is_id(&id), "{id}");
    let body = std::str::from_utf8(raw.body().bytes().expect("the error body in memory"))?;
    assert!(body.contains("<Code>NoSuchKey</Code>"), "{body}");
    assert!(body.contains(&format!("<RequestId>{id}</RequestId>")), "{body}");
    // A 404 to HEAD has no body, but still the header.
    let e = c.head_object().bucket("bkt").key("missing").send().await.expect_err("missing");
    assert!(e.raw_response().and_then(|r| r.headers().get("x-amz-request-id")).is_some_and(is_id));
    Ok(())
}

/// SSE-C: a PUT with a customer key stores the object encrypted; GET and
/// HEAD need that key (none: 400 InvalidRequest; another: 403 AccessDenied)
/// and echo its algorithm and MD5; ranges decrypt at any offset; a key whose
/// MD5 does not match is 400 InvalidArgument and stores nothing; the ETag is
/// no MD5 of the plaintext; a copy from an SSE-C object without its key is
/// refused.
async fn sse_c_objects_are_served_only_with_their_key(c: aws_sdk_s3::Client) -> R {
    c.create_bucket().bucket("bkt").send().await?;
    let ssec = |k: u8| (base64(&[k; 32]), base64(&md5::Md5::digest([k; 32])));
    let ((k1, m1), (k2, m2)) = (ssec(1), ssec(2));
    let big = pseudo_random(2 * 1024 * 1024 + 999, 9);
    for (name, data) in [("small", b"top secret".to_vec()), ("big", big.clone())] {
        let out = c
            .put_object()
            .bucket("bkt")
            .key(name)
            .sse_customer_algorithm("AES256")
            .sse_customer_key(&k1)
            .sse_customer_key_md5(&m1)
            .body(ByteStream::from(data.clone()))
            .send()
            .await?;
        assert_eq!(out.sse_customer_algorithm(), Some("AES256"));
        assert_eq!(out.sse_customer_key_md5(), Some(m1.as_str()));
        let plain_md5 = format!("\"{}\"", hex::encode(md5::Md5::digest(&data)));
        assert_ne!(out.e_tag(), Some(plain_md5.as_str()), "the ETag gives away the plaintext's MD5");

        let e = c.get_object().bucket("bkt").key(name).send().await.expect_err("GET without the key");
        assert_eq!((code(&e).as_str(), status(&e)), ("InvalidRequest", 400), "{name}");
        let e = c.head_object().bucket("bkt").key(name).send().await.expect_err("HEAD without the key");
        assert_eq!(status(&e), 400, "{name}");
        let e = c
            .get_object()
            .bucket("bkt")
            .key(name)
            .sse_customer_algorithm("AES256")
            .sse_customer_key(&k2)
            .sse_customer_key_md5(&m2)
            .send()
            .await
            .expect_err("GET with another key");
        assert_eq!((code(&e).as_str(), status(&e)), ("AccessDenied", 403), "{name}");
        let e = c
            .head_object()
            .bucket("bkt")
            .key(name)
            .sse_customer_algorithm("AES256")
            .sse_customer_key(&k2)
            .sse_customer_key_md5(&m2)
            .send()
            .await
            .expect_err("HEAD with another key");
        assert_eq!(status(&e), 403, "{name}");

        let out = c
            .get_object()
            .bucket("bkt")
            .key(name)
            .sse_customer_algorithm("AES256")
            .sse_customer_key(&k1)
            .sse_customer_key_md5(&m1)
            .send()
            .await?;
        assert_eq!(out.sse_customer_algorithm(), Some("AES256"));
        assert_eq!(out.sse_customer_key_md5(), Some(m1.as_str()));
        assert_eq!(body_of(out).await, data, "{name}");
        let head = c
            .head_object()
            .bucket("bkt")
            .key(name)
            .sse_customer_algorithm("AES256")
            .sse_customer_key(&k1)
            .sse_customer_key_md5(&m1)
            .send()
            .await?;
        assert_eq!(head.content_length(), Some(data.len() as i64));
        assert_eq!(head.sse_customer_key_md5(), Some(m1.as_str()));
    }
    // Ranges start and end inside AES blocks and cross a store block.
    for (first, last) in [(3usize, 20usize), (1_048_570, 1_048_600), (17, big.len() - 1)] {
        let out = c
            .get_object()
            .bucket("bkt")
            .key("big")
            .range(format!("bytes={first}-{last}"))
            .sse_customer_algorithm("AES256")
            .sse_customer_key(&k1)
            .sse_customer_key_md5(&m1)
            .send()
            .await?;
        assert_eq!(body_of(out).await, &big[first..=last], "{first}-{last}");
    }
    // A key whose MD5 is not the one given: refused, nothing stored.
    let e = c
        .put_object()
        .bucket("bkt")
        .key("wrong-md5")
        .sse_customer_algorithm("AES256")
        .sse_customer_key(&k1)
        .sse_customer_key_md5(&m2)
        .body(ByteStream::from_static(b"x"))
        .send()
        .await
        .expect_err("wrong key MD5");
    assert_eq!((code(&e).as_str(), status(&e)), ("InvalidArgument", 400));
    assert_eq!(status(&c.head_object().bucket("bkt").key("wrong-md5").send().await.expect_err("absent")), 404);
    // A copy of an SSE-C object without its key would hand out its bytes.
    let e = c.copy_object().bucket("bkt").key("copy").copy_source("bkt/small").send().await.expect_err("copy");
    assert_eq!(status(&e), 400);
    assert_eq!(status(&c.head_object().bucket("bkt").key("copy").send().await.expect_err("absent")), 404);
    // Plain objects stay plain; listing shows both.
    put(&c, "bkt", "plain", b"v").await;
    assert_eq!(body_of(c.get_object().bucket("bkt").key("plain").send().await?).await, b"v");
    assert_eq!(c.list_objects_v2().bucket("bkt").send().await?.key_count(), Some(3));
    Ok(())
}

/// Every file under `dir` (block files, metadata) holds `needle` somewhere.
fn on_disk(dir: &std::path::Path, needle: &[u8]) -> bool {
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let path = e.path();
            if path.is_dir() {
                stack.push(path);
            } else if let Ok(bytes) = std::fs::read(&path)
                && bytes.windows(needle.len()).any(|w| w == needle)
            {
                return true;
            }
        }
    }
    false
}

/// SSE-C multipart uploads: CreateMultipartUpload with a key records it;
/// every UploadPart must give that key (none: 400 InvalidRequest, another:
/// 403 AccessDenied) and is stored encrypted (its plaintext is nowhere on
/// disk, where a plain upload's is); a part uploaded again replaces the
/// first; ListParts and Complete work; GET/HEAD need the key, and ranges
/// across the part boundary, partNumber reads and a copy to a plain
/// object return the plaintext.
async fn sse_c_multipart_uploads_need_the_key_on_every_part(c: aws_sdk_s3::Client, dir: &std::path::Path) -> R {
    c.create_bucket().bucket("enc").send().await?;
    let ssec = |k: u8| (base64(&[k; 32]), base64(&md5::Md5::digest([k; 32])));
    let ((k1, m1), (k2, m2)) = (ssec(11), ssec(12));
    let parts = [pseudo_random(5 << 20, 50), pseudo_random(300_001, 51)];
    let whole = parts.concat();
    let up = c
        .create_multipart_upload()
        .bucket("enc")
        .key("big")
        .sse_customer_algorithm("AES256")
        .sse_customer_key(&k1)
        .sse_customer_key_md5(&m1)
        .send()
        .await?;
    assert_eq!(up.sse_customer_algorithm(), Some("AES256"));
    assert_eq!(up.sse_customer_key_md5(), Some(m1.as_str()));
    let id = up.upload_id().expect("upload id").to_owned();
    let part = |n: i32, data: Vec<u8>, key: Option<(&str, &str)>| {
        let r = c
            .upload_part()
            .bucket("enc")
            .key("big")
            .upload_id(&id)
            .part_number(n)
            .set_sse_customer_algorithm(key.map(|_| "AES256".to_owned()))
            .set_sse_customer_key(key.map(|k| k.0.to_owned()))
            .set_sse_customer_key_md5(key.map(|k| k.1.to_owned()))
            .body(ByteStream::from(data));
        async move { r.send().await }
    };
    let e = part(1, parts[0].clone(), None).await.expect_err("a part without the key");
    assert_eq!((code(&e).as_str(), status(&e)), ("InvalidRequest", 400));
    let e = part(1, parts[0].clone(), Some((&k2, &m2))).await.expect_err("a part with another key");
    assert_eq!((code(&e).as_str(), status(&e)), ("AccessDenied", 403));
    // Part 1 first with other bytes, then again with its own.
    part(1, pseudo_random(5 << 20, 59), Some((&k1, &m1))).await?;
    let mut done = Vec::new();
    for (n, data) in (1..).zip(&parts) {
        let out = part(n, data.clone(), Some((&k1, &m1))).await?;
        assert_eq!(out.sse_customer_key_md5(), Some(m1.as_str()));
        let plain_md5 = format!("\"{}\"", hex::encode(md5::Md5::digest(data)));
        assert_ne!(out.e_tag(), Some(plain_md5.as_str()), "a part's ETag gives away its plaintext's MD5");
        done.push(CompletedPart::builder().part_number(n).e_tag(out.e_tag().expect("etag")).build());
    }
    let listed = c.list_parts().bucket("enc").key("big").upload_id(&id).send().await?;
    let sizes: Vec<_> = listed.parts().iter().map(|p| (p.part_number(), p.size())).collect();
    assert_eq!(sizes, [(Some(1), Some(5 << 20)), (Some(2), Some(300_001))]);
    // The parts' checksums are of their plaintext: listed only with the
    // upload's key (the SDK sends a CRC32 with every part by default).
    let plain_sums = |l: &aws_sdk_s3::operation::list_parts::ListPartsOutput| {
        l.parts().iter().filter(|p| p.checksum_crc32().is_some() || p.checksum_crc32_c().is_some()).count()
    };
    assert_eq!(plain_sums(&listed), 0, "plaintext checksums listed without the key");
    let with_key = c
        .list_parts()
        .bucket("enc")
        .key("big")
        .upload_id(&id)
        .sse_customer_algorithm("AES256")
        .sse_customer_key(&k1)
        .sse_customer_key_md5(&m1)
        .send()
        .await?;
    assert_eq!(plain_sums(&with_key), 2, "with the key the parts' checksums are listed");
    let e = c
        .list_parts()
        .bucket("enc")
        .key("big")
        .upload_id(&id)
        .sse_customer_algorithm("AES256")
        .sse_customer_key(&k2)
        .sse_customer_key_md5(&m2)
        .send()
        .await
        .expect_err("ListParts with another key");
    assert_eq!((code(&e).as_str(), status(&e)), ("AccessDenied", 403));
    let e = c
        .complete_multipart_upload()
        .bucket("enc")
        .key("big")
        .upload_id(&id)
        .sse_customer_algorithm("AES256")
        .sse_customer_key(&k2)
        .sse_customer_key_md5(&m2)
        .multipart_upload(CompletedMultipartUpload::builder().set_parts(Some(done.clone())).build())
        .send()
        .await
        .expect_err("a complete naming another key");
    assert_eq!(status(&e), 403);
    let out = c
        .complete_multipart_upload()
        .bucket("enc")
        .key("big")
        .upload_id(&id)
        .multipart_upload(CompletedMultipartUpload::builder().set_parts(Some(done.clone())).build())
        .send()
        .await?;
    assert!(out.e_tag().is_some_and(|t| t.ends_with("-2\"")), "{:?}", out.e_tag());
    assert_eq!((out.checksum_crc32(), out.checksum_crc32_c()), (None, None), "plaintext checksum without the key");
    // A retry (a lost reply) with the key gets the same object and its checksum.
    let again = c
        .complete_multipart_upload()
        .bucket("enc")
        .key("big")
        .upload_id(&id)
        .sse_customer_algorithm("AES256")
        .sse_customer_key(&k1)
        .sse_customer_key_md5(&m1)
        .multipart_upload(CompletedMultipartUpload::builder().set_parts(Some(done)).build())
        .send()
        .await?;
    assert_eq!(again.e_tag(), out.e_tag());
    // An SSE-C upload with a whole-object checksum: the completion's answer
    // carries that (plaintext) checksum only to a request with the key.
    let sum = c
        .create_multipart_upload()
        .bucket("enc")
        .key("sum")
        .checksum_algorithm(aws_sdk_s3::types::ChecksumAlgorithm::Crc32)
        .sse_customer_algorithm("AES256")
        .sse_customer_key(&k1)
        .sse_customer_key_md5(&m1)
        .send()
        .await?;
    let sum_id = sum.upload_id().expect("upload id").to_owned();
    let p = c
        .upload_part()
        .bucket("enc")
        .key("sum")
        .upload_id(&sum_id)
        .part_number(1)
        .checksum_algorithm(aws_sdk_s3::types::ChecksumAlgorithm::Crc32)
        .sse_customer_algorithm("AES256")
        .sse_customer_key(&k1)
        .sse_customer_key_md5(&m1)
        .body(ByteStream::from(pseudo_random(1000, 52)))
        .send()
        .await?;
    let one = vec![
        CompletedPart::builder()
            .part_number(1)
            .e_tag(p.e_tag().expect("etag"))
            .set_checksum_crc32(p.checksum_crc32().map(str::to_owned))
            .build(),
    ];
    let complete = |key: Option<(&str, &str)>| {
        c.complete_multipart_upload()
            .bucket("enc")
            .key("sum")
            .upload_id(&sum_id)
            .set_sse_customer_algorithm(key.map(|_| "AES256".to_owned()))
            .set_sse_customer_key(key.map(|k| k.0.to_owned()))
            .set_sse_customer_key_md5(key.map(|k| k.1.to_owned()))
            .multipart_upload(CompletedMultipartUpload::builder().set_parts(Some(one.clone())).build())
            .send()
    };
    let without = complete(None).await?;
    assert_eq!(without.checksum_crc32(), None, "the plaintext checksum without the key");
    let with = complete(Some((&k1, &m1))).await?;
    assert_eq!(with.e_tag(), without.e_tag(), "the retry is answered as the first completion");
    assert!(with.checksum_crc32().is_some(), "with the key the checksum is given: {with:?}");

    let e = c.get_object().bucket("enc").key("big").send().await.expect_err("GET without the key");
    assert_eq!((code(&e).as_str(), status(&e)), ("InvalidRequest", 400));
    let get = |key: (&str, &str)| {
        c.get_object()
            .bucket("enc")
            .key("big")
            .sse_customer_algorithm("AES256")
            .sse_customer_key(key.0)
            .sse_customer_key_md5(key.1)
    };
    let e = get((&k2, &m2)).send().await.expect_err("GET with another key");
    assert_eq!((code(&e).as_str(), status(&e)), ("AccessDenied", 403));
    let out = get((&k1, &m1)).send().await?;
    assert_eq!(out.sse_customer_key_md5(), Some(m1.as_str()));
    assert!(body_of(out).await == whole, "the whole object");
    let boundary = 5usize << 20;
    for (first, last) in [(boundary - 100, boundary + 100), (boundary - 1, boundary), (7, whole.len() - 3)] {
        let out = get((&k1, &m1)).range(format!("bytes={first}-{last}")).send().await?;
        assert!(body_of(out).await == whole[first..=last], "{first}-{last}");
    }
    let out = get((&k1, &m1)).part_number(2).send().await?;
    assert_eq!(out.parts_count(), Some(2));
    assert!(body_of(out).await == parts[1], "part 2");
    let head = c
        .head_object()
        .bucket("enc")
        .key("big")
        .sse_customer_algorithm("AES256")
        .sse_customer_key(&k1)
        .sse_customer_key_md5(&m1)
        .send()
        .await?;
    assert_eq!(head.content_length(), Some(whole.len() as i64));
    let e = c.head_object().bucket("enc").key("big").send().await.expect_err("HEAD without the key");
    assert_eq!(status(&e), 400);

    // The plaintext of neither part is on disk; a plain object's is (which
    // shows the search finds what is there).
    for (n, p) in parts.iter().enumerate() {
        assert!(!on_disk(dir, &p[4096..4160]), "part {} is stored in plaintext", n + 1);
    }
    let plain = pseudo_random(300_000, 52);
    put(&c, "enc", "plain", &plain).await;
    assert!(on_disk(dir, &plain[4096..4160]), "a plain object's bytes are not found on disk");

    // A copy with the key decrypts every part into a plain object.
    c.copy_object()
        .bucket("enc")
        .key("big-plain")
        .copy_source("enc/big")
        .copy_source_sse_customer_algorithm("AES256")
        .copy_source_sse_customer_key(&k1)
        .copy_source_sse_customer_key_md5(&m1)
        .send()
        .await?;
    let out = c.get_object().bucket("enc").key("big-plain").send().await?;
    assert!(body_of(out).await == whole, "the plain copy");
    // A part of a plain upload with a key, or a part with a key MD5 that is
    // not its key's: refused.
    let plain_up = c.create_multipart_upload().bucket("enc").key("p").send().await?;
    let e = c
        .upload_part()
        .bucket("enc")
        .key("p")
        .upload_id(plain_up.upload_id().expect("id"))
        .part_number(1)
        .sse_customer_algorithm("AES256")
        .sse_customer_key(&k1)
        .sse_customer_key_md5(&m1)
        .body(ByteStream::from_static(b"x"))
        .send()
        .await
        .expect_err("a key for a plain upload");
    assert_eq!(status(&e), 400);
    let e = c
        .upload_part()
        .bucket("enc")
        .key("p")
        .upload_id(plain_up.upload_id().expect("id"))
        .part_number(1)
        .sse_customer_algorithm("AES256")
        .sse_customer_key(&k1)
        .sse_customer_key_md5(&m2)
        .body(ByteStream::from_static(b"x"))
        .send()
        .await
        .expect_err("a key MD5 that is not the key's");
    assert_eq!((code(&e).as_str(), status(&e)), ("InvalidArgument", 400));
    Ok(())
}

/// CopyObject and UploadPartCopy from an SSE-C source need its key in the
/// `x-amz-copy-source-server-side-encryption-customer-*` headers (none:
/// 400, another: 403, and nothing is stored); the destination is plain or
/// SSE-C under its own key; an object copied onto itself with a new key is
/// a key rotation; a plain source copied with a key is encrypted.
async fn sse_c_copies_need_the_source_key_and_may_change_or_drop_the_key(c: aws_sdk_s3::Client) -> R {
    c.create_bucket().bucket("cpy").send().await?;
    let ssec = |k: u8| (base64(&[k; 32]), base64(&md5::Md5::digest([k; 32])));
    let ((k1, m1), (k2, m2), (k3, m3)) = (ssec(21), ssec(22), ssec(23));
    let data = pseudo_random(1_300_000, 60);
    c.put_object()
        .bucket("cpy")
        .key("src")
        .sse_customer_algorithm("AES256")
        .sse_customer_key(&k1)
        .sse_customer_key_md5(&m1)
        .body(ByteStream::from(data.clone()))
        .send()
        .await?;
    let copy = |dst: &str, src_key: Option<(&str, &str)>, dst_key: Option<(&str, &str)>| {
        c.copy_object()
            .bucket("cpy")
            .key(dst)
            .copy_source("cpy/src")
            .set_copy_source_sse_customer_algorithm(src_key.map(|_| "AES256".to_owned()))
            .set_copy_source_sse_customer_key(src_key.map(|k| k.0.to_owned()))
            .set_copy_source_sse_customer_key_md5(src_key.map(|k| k.1.to_owned()))
            .set_sse_customer_algorithm(dst_key.map(|_| "AES256".to_owned()))
            .set_sse_customer_key(dst_key.map(|k| k.0.to_owned()))
            .set_sse_customer_key_md5(dst_key.map(|k| k.1.to_owned()))
    };
    let get = |key: &str, with: Option<(&str, &str)>| {
        c.get_object()
            .bucket("cpy")
            .key(key)
            .set_sse_customer_algorithm(with.map(|_| "AES256".to_owned()))
            .set_sse_customer_key(with.map(|k| k.0.to_owned()))
            .set_sse_customer_key_md5(with.map(|k| k.1.to_owned()))
            .send()
    };
    let cref = &c;
    let absent = move |key: &'static str| async move {
        status(&cref.head_object().bucket("cpy").key(key).send().await.expect_err(key)) == 404
    };

    let e = copy("out", None, None).send().await.expect_err("no source key");
    assert_eq!((code(&e).as_str(), status(&e)), ("InvalidRequest", 400));
    let e = copy("out", Some((&k2, &m2)), Some((&k2, &m2))).send().await.expect_err("another source key");
    assert_eq!((code(&e).as_str(), status(&e)), ("AccessDenied", 403));
    assert!(absent("out").await, "a refused copy stored something");

    // To a plain object.
    copy("plain", Some((&k1, &m1)), None).send().await?;
    assert!(body_of(get("plain", None).await?).await == data, "decrypted copy");
    // To an SSE-C object under another key.
    let out = copy("other", Some((&k1, &m1)), Some((&k2, &m2))).send().await?;
    assert_eq!(out.sse_customer_key_md5(), Some(m2.as_str()));
    assert!(body_of(get("other", Some((&k2, &m2))).await?).await == data, "re-encrypted copy");
    assert_eq!(status(&get("other", Some((&k1, &m1))).await.expect_err("the source's key")), 403);
    assert_eq!(status(&get("other", None).await.expect_err("no key")), 400);
    // Onto itself with a new key: the old key no longer opens it.
    let out = c
        .copy_object()
        .bucket("cpy")
        .key("src")
        .copy_source("cpy/src")
        .copy_source_sse_customer_algorithm("AES256")
        .copy_source_sse_customer_key(&k1)
        .copy_source_sse_customer_key_md5(&m1)
        .sse_customer_algorithm("AES256")
        .sse_customer_key(&k3)
        .sse_customer_key_md5(&m3)
        .send()
        .await?;
    assert_eq!(out.sse_customer_key_md5(), Some(m3.as_str()));
    assert!(body_of(get("src", Some((&k3, &m3))).await?).await == data, "rotated");
    assert_eq!(status(&get("src", Some((&k1, &m1))).await.expect_err("the old key")), 403);
    // A plain source copied with a key is encrypted.
    put(&c, "cpy", "p", b"plain bytes").await;
    c.copy_object()
        .bucket("cpy")
        .key("p-enc")
        .copy_source("cpy/p")
        .sse_customer_algorithm("AES256")
        .sse_customer_key(&k1)
        .sse_customer_key_md5(&m1)
        .send()
        .await?;
    assert_eq!(status(&get("p-enc", None).await.expect_err("no key")), 400);
    assert_eq!(body_of(get("p-enc", Some((&k1, &m1))).await?).await, b"plain bytes");
    // A plain source named with a source key: refused, as a GET is.
    let e = c
        .copy_object()
        .bucket("cpy")
        .key("p-bad")
        .copy_source("cpy/p")
        .copy_source_sse_customer_algorithm("AES256")
        .copy_source_sse_customer_key(&k1)
        .copy_source_sse_customer_key_md5(&m1)
        .send()
        .await
        .expect_err("a source key for a plain source");
    assert_eq!(status(&e), 400);
    assert!(absent("p-bad").await);

    // UploadPartCopy from the (now k3) source into an upload under k2.
    let up = c
        .create_multipart_upload()
        .bucket("cpy")
        .key("mpu")
        .sse_customer_algorithm("AES256")
        .sse_customer_key(&k2)
        .sse_customer_key_md5(&m2)
        .send()
        .await?;
    let id = up.upload_id().expect("id").to_owned();
    let part_copy = |src_key: Option<(&str, &str)>, dst_key: Option<(&str, &str)>| {
        c.upload_part_copy()
            .bucket("cpy")
            .key("mpu")
            .upload_id(&id)
            .part_number(1)
            .copy_source("cpy/src")
            .set_copy_source_sse_customer_algorithm(src_key.map(|_| "AES256".to_owned()))
            .set_copy_source_sse_customer_key(src_key.map(|k| k.0.to_owned()))
            .set_copy_source_sse_customer_key_md5(src_key.map(|k| k.1.to_owned()))
            .set_sse_customer_algorithm(dst_key.map(|_| "AES256".to_owned()))
            .set_sse_customer_key(dst_key.map(|k| k.0.to_owned()))
            .set_sse_customer_key_md5(dst_key.map(|k| k.1.to_owned()))
            .send()
    };
    let e = part_copy(Some((&k1, &m1)), Some((&k2, &m2))).await.expect_err("the source's old key");
    assert_eq!(status(&e), 403);
    let e = part_copy(None, Some((&k2, &m2))).await.expect_err("no source key");
    assert_eq!(status(&e), 400);
    let e = part_copy(Some((&k3, &m3)), None).await.expect_err("no key for the upload");
    assert_eq!(status(&e), 400);
    let listed = c.list_parts().bucket("cpy").key("mpu").upload_id(&id).send().await?;
    assert!(listed.parts().is_empty(), "a refused part copy stored a part");
    let out = part_copy(Some((&k3, &m3)), Some((&k2, &m2))).await?;
    assert_eq!(out.sse_customer_key_md5(), Some(m2.as_str()));
    let tag = out.copy_part_result().and_then(|r| r.e_tag()).expect("etag").to_owned();
    c.complete_multipart_upload()
        .bucket("cpy")
        .key("mpu")
        .upload_id(&id)
        .multipart_upload(
            CompletedMultipartUpload::builder()
                .parts(CompletedPart::builder().part_number(1).e_tag(tag).build())
                .build(),
        )
        .send()
        .await?;
    assert!(body_of(get("mpu", Some((&k2, &m2))).await?).await == data, "part copied and re-encrypted");
    assert_eq!(status(&get("mpu", Some((&k3, &m3))).await.expect_err("the source's key")), 403);
    Ok(())
}

/// `x-amz-checksum-type: FULL_OBJECT` on CreateMultipartUpload: the object's
/// CRC32 / CRC32C / CRC64NVME is the CRC of all its bytes (combined from the
/// parts' CRCs), as the SDK checks it: Complete returns it, a Complete that
/// claims another value is BadDigest and leaves the upload, GET returns it.
/// CRC64NVME is FULL_OBJECT by default; FULL_OBJECT with a SHA, COMPOSITE
/// with CRC64NVME, a type without an algorithm, and a Complete naming the
/// other type are InvalidRequest.
async fn full_object_multipart_checksums_are_the_crc_of_the_whole_object(c: aws_sdk_s3::Client) -> R {
    use aws_sdk_s3::types::ChecksumType;
    use lightningstor::checksum::ChecksumAlgo;
    c.create_bucket().bucket("full").send().await?;
    let parts = [pseudo_random(5 << 20, 40), pseudo_random(777_777, 41)];
    let whole = parts.concat();
    let cases = [
        (ChecksumAlgorithm::Crc32, ChecksumAlgo::Crc32, Some(ChecksumType::FullObject)),
        (ChecksumAlgorithm::Crc32C, ChecksumAlgo::Crc32c, Some(ChecksumType::FullObject)),
        (ChecksumAlgorithm::Crc64Nvme, ChecksumAlgo::Crc64Nvme, None),
    ];
    for (algo, ours, asked) in cases {
        let key = format!("k-{}", algo.as_str());
        let up = c
            .create_multipart_upload()
            .bucket("full")
            .key(&key)
            .checksum_algorithm(algo.clone())
            .set_checksum_type(asked)
            .send()
            .await?;
        assert_eq!(up.checksum_type(), Some(&ChecksumType::FullObject), "{algo:?}");
        let id = up.upload_id().expect("upload id").to_owned();
        let mut done_parts = Vec::new();
        for (n, data) in (1..).zip(&parts) {
            let p = c
                .upload_part()
                .bucket("full")
                .key(&key)
                .upload_id(&id)
                .part_number(n)
                .checksum_algorithm(algo.clone())
                .body(ByteStream::from(data.clone()))
                .send()
                .await?;
            done_parts.push(CompletedPart::builder().part_number(n).e_tag(p.e_tag().expect("etag")).build());
        }
        let want = base64(&ours.digest(&whole));
        let complete = |claim: String, kind: ChecksumType| {
            let r = c
                .complete_multipart_upload()
                .bucket("full")
                .key(&key)
                .upload_id(&id)
                .checksum_type(kind)
                .multipart_upload(CompletedMultipartUpload::builder().set_parts(Some(done_parts.clone())).build());
            match ours {
                ChecksumAlgo::Crc32 => r.checksum_crc32(claim),
                ChecksumAlgo::Crc32c => r.checksum_crc32_c(claim),
                _ => r.checksum_crc64_nvme(claim),
            }
            .send()
        };
        // The part CRCs' own composite is not the object's CRC.
        let wrong = base64(&ours.digest(&parts[0]));
        let e = complete(wrong, ChecksumType::FullObject).await.expect_err("a wrong whole-object CRC");
        assert_eq!(code(&e), "BadDigest", "{algo:?}");
        let e = complete(want.clone(), ChecksumType::Composite).await.expect_err("the other type");
        assert_eq!(code(&e), "InvalidRequest", "{algo:?}");
        let done = complete(want.clone(), ChecksumType::FullObject).await?;
        assert_eq!(done.checksum_type(), Some(&ChecksumType::FullObject));
        let got = [done.checksum_crc32(), done.checksum_crc32_c(), done.checksum_crc64_nvme()];
        assert_eq!(got.into_iter().flatten().collect::<Vec<_>>(), [want.as_str()], "{algo:?}");

        let out = c.get_object().bucket("full").key(&key).checksum_mode(ChecksumMode::Enabled).send().await?;
        assert_eq!(out.checksum_type(), Some(&ChecksumType::FullObject));
        let got = [out.checksum_crc32(), out.checksum_crc32_c(), out.checksum_crc64_nvme()];
        assert_eq!(got.into_iter().flatten().collect::<Vec<_>>(), [want.as_str()], "{algo:?}");
        assert_eq!(body_of(out).await, whole);
    }

    let create = |algo: Option<ChecksumAlgorithm>, kind: Option<ChecksumType>| {
        c.create_multipart_upload()
            .bucket("full")
            .key("refused")
            .set_checksum_algorithm(algo)
            .set_checksum_type(kind)
            .send()
    };
    for (algo, kind) in [
        (Some(ChecksumAlgorithm::Sha256), Some(ChecksumType::FullObject)),
        (Some(ChecksumAlgorithm::Crc64Nvme), Some(ChecksumType::Composite)),
        (None, Some(ChecksumType::FullObject)),
    ] {
        let e = create(algo.clone(), kind.clone()).await.expect_err("refused");
        assert_eq!(code(&e), "InvalidRequest", "{algo:?} {kind:?}");
    }
    // COMPOSITE stays the default for the other algorithms.
    let up = create(Some(ChecksumAlgorithm::Crc32), None).await?;
    assert_eq!(up.checksum_type(), Some(&ChecksumType::Composite));
    Ok(())
}

/// The request line and headers of a SigV4 header-signed request to `host`
/// whose body is sent with `Transfer-Encoding: chunked` (no Content-Length,
/// which is not signed): `payload` is the signed `x-amz-content-sha256`.
fn chunked_request_head(method: &str, host: &str, path: &str, payload: &str) -> String {
    chunked_request_head_as(method, host, path, payload, (AK, SK))
}

/// [`chunked_request_head`] signed with the key pair `(access key, secret)`.
fn chunked_request_head_as(method: &str, host: &str, path: &str, payload: &str, key: (&str, &str)) -> String {
    use aws_sigv4::http_request::{SignableBody, SignableRequest, SigningSettings, sign};
    let uri = format!("http://{host}{path}");
    let headers = [("host", host), ("x-amz-content-sha256", payload)];
    let identity = aws_credential_types::Credentials::new(key.0, key.1, None, None, "t").into();
    let params = signing_params(&identity, SigningSettings::default());
    let signable =
        SignableRequest::new(method, uri.clone(), headers.iter().copied(), SignableBody::Precomputed(payload.into()))
            .expect("signable");
    let (instructions, _) = sign(signable, &params).expect("sign").into_parts();
    let mut req = http::Request::builder().method(method).uri(uri);
    for (k, v) in headers {
        req = req.header(k, v);
    }
    let mut req = req.body(()).expect("request");
    instructions.apply_to_request_http1x(&mut req);
    let mut head = format!("{method} {path} HTTP/1.1\r\n");
    for (k, v) in req.headers() {
        head.push_str(&format!("{k}: {}\r\n", v.to_str().expect("ascii header")));
    }
    head.push_str("Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n");
    head
}

/// Sends `head` and `data` in HTTP/1.1 chunked transfer coding (uneven
/// chunks) to `addr`; the status and the whole reply.
async fn send_chunked(addr: std::net::SocketAddr, head: String, data: Vec<u8>) -> (u16, String) {
    tokio::task::spawn_blocking(move || {
        use std::io::Write;
        let mut s = std::net::TcpStream::connect(addr).expect("connect");
        // A server that answers early (411) and closes cuts the upload
        // short: then its reply is what the test sees.
        let _ = (|| -> std::io::Result<()> {
            s.write_all(head.as_bytes())?;
            for chunk in data.chunks(100_003) {
                s.write_all(format!("{:x}\r\n", chunk.len()).as_bytes())?;
                s.write_all(chunk)?;
                s.write_all(b"\r\n")?;
            }
            s.write_all(b"0\r\n\r\n")
        })();
        let (text, _) = read_reply(&mut s, Duration::from_secs(30));
        let status = text.get(9..12).and_then(|c| c.parse().ok()).unwrap_or(0);
        (status, text)
    })
    .await
    .expect("sender")
}

/// A PUT whose body comes with `Transfer-Encoding: chunked` and no
/// Content-Length (curl streaming a pipe; the compatibility suite's
/// chunked-transfer case) is stored, not refused with 411: header-signed
/// with UNSIGNED-PAYLOAD or with the body's SHA-256, presigned, and as an
/// UploadPart. A body that does not match its signed SHA-256 is still
/// XAmzContentSHA256Mismatch and stores nothing.
async fn chunked_transfer_encoding_puts_are_stored(svc: s3s::service::S3Service) -> R {
    use sha2::Digest as _;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let metrics: lightningstor::server::MetricsFn = std::sync::Arc::new(String::new);
    let running = lightningstor::server::serve_with_limits(listener, svc, metrics, None, Default::default())?;
    let addr = running.addr;
    let host = addr.to_string();
    let c = aws_sdk_s3::Client::from_conf(sdk_config(&format!("http://{addr}"), AK, SK).build());
    c.create_bucket().bucket("chunky").send().await?;
    let data = pseudo_random((3 << 20) + 17, 50);
    let sha = hex::encode(sha2::Sha256::digest(&data));

    for (key, payload) in [("unsigned", "UNSIGNED-PAYLOAD"), ("signed", sha.as_str())] {
        let head = chunked_request_head("PUT", &host, &format!("/chunky/{key}"), payload);
        let (st, text) = send_chunked(addr, head, data.clone()).await;
        assert_eq!(st, 200, "{key}: {text}");
        let out = c.get_object().bucket("chunky").key(key).send().await?;
        assert_eq!(out.content_length(), Some(data.len() as i64), "{key}");
        assert_eq!(body_of(out).await, data, "{key}");
    }
    let other = hex::encode(sha2::Sha256::digest(b"other bytes"));
    let (st, text) =
        send_chunked(addr, chunked_request_head("PUT", &host, "/chunky/wrong", &other), data.clone()).await;
    assert_eq!(st, 400, "{text}");
    assert!(text.contains("XAmzContentSHA256Mismatch"), "{text}");
    let e = c.head_object().bucket("chunky").key("wrong").send().await.expect_err("nothing stored");
    assert_eq!(status(&e), 404);

    let target = presigned_put_target(&c, "chunky", "presigned").await;
    let head =
        format!("PUT {target} HTTP/1.1\r\nHost: {host}\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n");
    let (st, text) = send_chunked(addr, head, b"streamed".to_vec()).await;
    assert_eq!(st, 200, "{text}");
    assert_eq!(body_of(c.get_object().bucket("chunky").key("presigned").send().await?).await, b"streamed");

    let up = c.create_multipart_upload().bucket("chunky").key("mp").send().await?;
    let id = up.upload_id().expect("upload id");
    let path = format!("/chunky/mp?partNumber=1&uploadId={id}");
    let (st, text) =
        send_chunked(addr, chunked_request_head("PUT", &host, &path, "UNSIGNED-PAYLOAD"), data.clone()).await;
    assert_eq!(st, 200, "{text}");
    let parts = c.list_parts().bucket("chunky").key("mp").upload_id(id).send().await?;
    assert_eq!(parts.parts().first().and_then(|p| p.size()), Some(data.len() as i64));
    running.shutdown().await;
    Ok(())
}

/// A body without a length goes to a temporary file before s3s can check
/// the signature (it needs the length); only a request that names a key the
/// server knows gets that far. Unsigned, or signed with a key the server
/// does not have, the answer comes at once, with no body sent at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_length_less_body_without_a_known_key_is_refused_before_it_is_read() -> R {
    let _gate = crate::gate::shared();
    let dir = tempfile::tempdir()?;
    let mut cfg = lightningstor::config::Config::new(dir.path()).with_keys(AK, SK);
    cfg.listen = "127.0.0.1:0".parse()?;
    let (running, _store) = lightningstor::server::start(cfg).await?;
    let addr = running.addr;
    let host = addr.to_string();
    let c = aws_sdk_s3::Client::from_conf(sdk_config(&format!("http://{addr}"), AK, SK).build());
    c.create_bucket().bucket("guarded").send().await?;
    let unsigned =
        format!("PUT /guarded/k HTTP/1.1\r\nHost: {host}\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n");
    let stranger = chunked_request_head_as("PUT", &host, "/guarded/k", "UNSIGNED-PAYLOAD", ("LSNOSUCHKEY", "nope"));
    for (head, status, code) in [(unsigned, 403, "AccessDenied"), (stranger, 403, "InvalidAccessKeyId")] {
        let (text, closed) = tokio::task::spawn_blocking(move || {
            use std::io::Write;
            let mut s = std::net::TcpStream::connect(addr).expect("connect");
            s.write_all(head.as_bytes()).expect("head");
            read_reply(&mut s, Duration::from_secs(10))
        })
        .await?;
        assert!(closed, "the server answered and closed without waiting for a body: {text}");
        assert!(text.starts_with(&format!("HTTP/1.1 {status}")), "{text}");
        assert!(text.contains(code) && text.contains("<RequestId>"), "{text}");
    }
    let e = c.head_object().bucket("guarded").key("k").send().await.expect_err("nothing stored");
    assert_eq!(status(&e), 404);
    // The server's own key still streams such a body.
    let head = chunked_request_head("PUT", &host, "/guarded/k", "UNSIGNED-PAYLOAD");
    let (st, text) = send_chunked(addr, head, b"mine".to_vec()).await;
    assert_eq!(st, 200, "{text}");
    assert_eq!(body_of(c.get_object().bucket("guarded").key("k").send().await?).await, b"mine");
    running.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunked_transfer_encoding_single_node() -> R {
    let _gate = crate::gate::shared();
    let s = InProcess::new();
    chunked_transfer_encoding_puts_are_stored(s.service.clone()).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunked_transfer_encoding_three_node_cluster() -> R {
    let _gate = crate::gate::shared();
    let s = InCluster::new(3);
    let svc = s.service();
    chunked_transfer_encoding_puts_are_stored(svc).await
}

/// A browser form upload (POST object) signed with SigV4: the policy is
/// `conditions` plus the eq conditions on the signing fields s3s requires,
/// expiring at `expiration`; `key` and the file go in the form. Sent over
/// TCP to `addr`; the status and the whole reply.
async fn post_object(
    addr: std::net::SocketAddr,
    bucket: &str,
    expiration: &str,
    conditions: &[&str],
    key: &str,
    file: &str,
    data: &[u8],
) -> (u16, String) {
    use aws_sdk_s3::primitives::DateTimeFormat;
    let now = std::time::SystemTime::now();
    let secs = now.duration_since(std::time::UNIX_EPOCH).expect("clock").as_secs();
    let iso = DateTime::from_secs(secs as i64).fmt(DateTimeFormat::DateTime).expect("date");
    let amz_date = iso.replace(['-', ':'], "");
    let credential = format!("{AK}/{}/us-east-1/s3/aws4_request", &amz_date[..8]);
    let mut all: Vec<String> = conditions.iter().map(|c| (*c).to_owned()).collect();
    all.push(format!("{{\"x-amz-date\": \"{amz_date}\"}}"));
    all.push(format!("{{\"x-amz-credential\": \"{credential}\"}}"));
    all.push("{\"x-amz-algorithm\": \"AWS4-HMAC-SHA256\"}".to_owned());
    let policy =
        base64(format!("{{\"expiration\": \"{expiration}\", \"conditions\": [{}]}}", all.join(", ")).as_bytes());
    let key_at = std::time::UNIX_EPOCH + Duration::from_secs(secs);
    let signing_key = aws_sigv4::sign::v4::generate_signing_key(SK, key_at, "us-east-1", "s3");
    let signature = aws_sigv4::sign::v4::calculate_signature(signing_key, policy.as_bytes());
    let mut body = Vec::new();
    for (k, v) in [
        ("key", key),
        ("x-amz-algorithm", "AWS4-HMAC-SHA256"),
        ("x-amz-credential", credential.as_str()),
        ("x-amz-date", amz_date.as_str()),
        ("policy", policy.as_str()),
        ("x-amz-signature", signature.as_str()),
    ] {
        body.extend_from_slice(
            format!("--FORMB\r\nContent-Disposition: form-data; name=\"{k}\"\r\n\r\n{v}\r\n").as_bytes(),
        );
    }
    body.extend_from_slice(
        format!("--FORMB\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{file}\"\r\nContent-Type: text/plain\r\n\r\n").as_bytes(),
    );
    body.extend_from_slice(data);
    body.extend_from_slice(b"\r\n--FORMB--\r\n");
    let head = format!(
        "POST /{bucket} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: multipart/form-data; boundary=FORMB\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    tokio::task::spawn_blocking(move || {
        use std::io::Write;
        let mut s = std::net::TcpStream::connect(addr).expect("connect");
        s.write_all(head.as_bytes()).expect("head");
        s.write_all(&body).expect("body");
        let (text, _) = read_reply(&mut s, Duration::from_secs(30));
        (text.get(9..12).and_then(|c| c.parse().ok()).unwrap_or(0), text)
    })
    .await
    .expect("sender")
}

/// POST object (browser form upload): `${filename}` in the key field is the
/// uploaded file's name, and the policy is checked against that key; a form
/// that breaks a policy condition is 403 AccessDenied; a policy whose
/// expiration is malformed is 400 and one that has expired 403; nothing is
/// stored by a refused form.
async fn post_object_forms_follow_their_policy(svc: s3s::service::S3Service) -> R {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let metrics: lightningstor::server::MetricsFn = std::sync::Arc::new(String::new);
    let running = lightningstor::server::serve_with_limits(listener, svc, metrics, None, Default::default())?;
    let addr = running.addr;
    let c = aws_sdk_s3::Client::from_conf(sdk_config(&format!("http://{addr}"), AK, SK).build());
    c.create_bucket().bucket("forms").send().await?;
    let later = "2099-01-01T00:00:00Z";
    let data = pseudo_random(100_000, 60);

    let cond = |key: &str| vec!["{\"bucket\": \"forms\"}".to_owned(), format!("[\"eq\", \"$key\", \"{key}\"]")];
    let c1 = cond("up/photo.txt");
    let c1: Vec<&str> = c1.iter().map(String::as_str).collect();
    let (st, text) = post_object(addr, "forms", later, &c1, "up/${filename}", "photo.txt", &data).await;
    assert_eq!(st, 204, "{text}");
    assert_eq!(body_of(c.get_object().bucket("forms").key("up/photo.txt").send().await?).await, data);

    // The key (after the substitution) breaks the policy: 403, nothing stored.
    let (st, text) = post_object(addr, "forms", later, &c1, "up/${filename}", "other.txt", &data).await;
    assert_eq!(st, 403, "{text}");
    assert!(text.contains("<Code>AccessDenied</Code>") && text.contains("Invalid according to Policy"), "{text}");
    let e = c.head_object().bucket("forms").key("up/other.txt").send().await.expect_err("not stored");
    assert_eq!(status(&e), 404);

    let c2 = cond("plain");
    let c2: Vec<&str> = c2.iter().map(String::as_str).collect();
    let (st, text) = post_object(addr, "forms", "next tuesday", &c2, "plain", "f", b"x").await;
    assert_eq!(st, 400, "a malformed expiration: {text}");
    assert!(text.contains("InvalidPolicyDocument"), "{text}");
    // s3s answers this one before any handler: the front end still gives
    // it a request id, the same in the header and the XML.
    let id = text
        .lines()
        .find_map(|l| l.split_once(':').filter(|(k, _)| k.eq_ignore_ascii_case("x-amz-request-id")))
        .map(|(_, v)| v.trim().to_owned())
        .expect("x-amz-request-id on an error s3s answered");
    assert!(text.contains(&format!("<RequestId>{id}</RequestId>")), "{text}");
    let (st, text) = post_object(addr, "forms", "2001-01-01T00:00:00Z", &c2, "plain", "f", b"x").await;
    assert_eq!(st, 403, "an expired policy: {text}");
    assert!(text.contains("AccessDenied"), "{text}");
    let e = c.head_object().bucket("forms").key("plain").send().await.expect_err("not stored");
    assert_eq!(status(&e), 404);
    running.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn post_object_single_node() -> R {
    let _gate = crate::gate::shared();
    let s = InProcess::new();
    post_object_forms_follow_their_policy(s.service.clone()).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn post_object_three_node_cluster() -> R {
    let _gate = crate::gate::shared();
    let s = InCluster::new(3);
    let svc = s.service();
    post_object_forms_follow_their_policy(svc).await
}

/// Operations outside the compatibility table of docs/lightningstor.md
/// (versioning, ACLs, policies, tagging, CORS, object attributes) answer
/// 501 NotImplemented and change nothing.
async fn operations_we_do_not_serve_answer_not_implemented(c: aws_sdk_s3::Client) -> R {
    use aws_sdk_s3::types::{ObjectAttributes, Tag, Tagging};
    c.create_bucket().bucket("bkt").send().await?;
    put(&c, "bkt", "k", b"v").await;
    let mut codes = Vec::new();
    let e = c.get_object_acl().bucket("bkt").key("k").send().await.expect_err("acl");
    codes.push(("GetObjectAcl", code(&e), status(&e)));
    let e = c.put_bucket_policy().bucket("bkt").policy("{}").send().await.expect_err("policy");
    codes.push(("PutBucketPolicy", code(&e), status(&e)));
    let tags = Tagging::builder().tag_set(Tag::builder().key("a").value("b").build()?).build()?;
    let e = c.put_object_tagging().bucket("bkt").key("k").tagging(tags).send().await.expect_err("tagging");
    codes.push(("PutObjectTagging", code(&e), status(&e)));
    let e = c.get_bucket_cors().bucket("bkt").send().await.expect_err("cors");
    codes.push(("GetBucketCors", code(&e), status(&e)));
    let e = c
        .get_object_attributes()
        .bucket("bkt")
        .key("k")
        .object_attributes(ObjectAttributes::ObjectSize)
        .send()
        .await
        .expect_err("attributes");
    codes.push(("GetObjectAttributes", code(&e), status(&e)));
    for (op, code, status) in codes {
        assert_eq!((code.as_str(), status), ("NotImplemented", 501), "{op}");
    }
    assert_eq!(body_of(c.get_object().bucket("bkt").key("k").send().await?).await, b"v");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_made_with_the_cli_get_exactly_their_bucket_permissions_single_node() -> R {
    let _gate = crate::gate::shared();
    let dir = tempfile::tempdir()?;
    let server = Spawned::start(dir.path(), &[]);
    let addr = server.addr.clone();
    let cli = |args: &[&str]| {
        let mut a = args.to_vec();
        a.extend(["--endpoint", addr.as_str()]);
        run_cli(&a, &[("LIGHTNINGSTOR_ACCESS_KEY", AK), ("LIGHTNINGSTOR_SECRET_KEY", SK)])
    };
    let (bob, secret) = keys_and_permissions(&cli, &[server.endpoint()]).await;

    // Keys and grants are in the metadata: they survive a restart.
    server.stop();
    let server = Spawned::start(dir.path(), &[]);
    let c = client_of(&server.endpoint(), &bob, &secret);
    c.get_object().bucket("adminb").key("k").send().await?;
    let e = c.delete_object().bucket("adminb").key("k").send().await.expect_err("read only");
    assert_eq!(code(&e), "AccessDenied");

    // Admin requests take the admin key only.
    let addr = server.addr.clone();
    let (good, _, err) = run_cli(
        &["key", "list", "--endpoint", &addr],
        &[("LIGHTNINGSTOR_ACCESS_KEY", &bob), ("LIGHTNINGSTOR_SECRET_KEY", &secret)],
    );
    assert!(!good && err.contains("admin key"), "{err}");
    let (good, _, err) = run_cli(
        &["key", "list", "--endpoint", &addr],
        &[("LIGHTNINGSTOR_ACCESS_KEY", AK), ("LIGHTNINGSTOR_SECRET_KEY", "wrong")],
    );
    assert!(!good && err.contains("signature does not match"), "{err}");
    let (good, _, err) = run_cli(&["key", "list", "--endpoint", &addr], &[]);
    assert!(!good && err.contains("no admin key"), "{err}");

    // A recorded admin request sent again is refused, as is one without a nonce.
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_secs() as i64;
    let send = |target: &str| {
        let auth = lightningstor::admin::authorization(AK, SK, secs, "POST", target);
        let url = format!("http://{addr}{target}");
        async move {
            let r = reqwest::Client::new().post(url).header("authorization", auth).send().await?;
            Ok::<_, reqwest::Error>((r.status().as_u16(), r.text().await?))
        }
    };
    let node = lightningstor::admin::encode(&addr);
    let once = format!("/_admin/keys?name=carol&nonce={}&node={node}", lightningstor::admin::new_nonce()?);
    let (status, body) = send(&once).await?;
    assert_eq!(status, 200, "{body}");
    let (status, body) = send(&once).await?;
    assert!(status == 403 && body.contains("replay"), "{status} {body}");
    let (status, body) = send(&format!("/_admin/keys?name=dave&node={node}")).await?;
    assert!(status == 403 && body.contains("nonce"), "{status} {body}");
    // One that names no node, or another one, is refused too.
    let (status, body) = send(&format!("/_admin/keys?name=dave&nonce={}", lightningstor::admin::new_nonce()?)).await?;
    assert!(status == 403 && body.contains("must name the node"), "{status} {body}");
    let elsewhere = format!("/_admin/keys?name=dave&nonce={}&node=127.0.0.1%3A1", lightningstor::admin::new_nonce()?);
    let (status, body) = send(&elsewhere).await?;
    assert!(status == 403 && body.contains("another node"), "{status} {body}");
    let (good, out, err) = run_cli(
        &["key", "list", "--endpoint", &addr],
        &[("LIGHTNINGSTOR_ACCESS_KEY", AK), ("LIGHTNINGSTOR_SECRET_KEY", SK)],
    );
    assert!(good, "{err}");
    let named = |n: &str| out.lines().filter(|l| l.split_whitespace().nth(1) == Some(n)).count();
    assert_eq!((named("carol"), named("dave")), (1, 0), "{out}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_anonymous_server_without_keys_serves_requests_signed_with_any_key() -> R {
    let _gate = crate::gate::shared();
    let dir = tempfile::tempdir()?;
    let server = Spawned::start_anonymous_without_keys(dir.path());
    let c = client_of(&server.endpoint(), "whoever", "whatever");
    c.create_bucket().bucket("open").send().await?;
    let data = pseudo_random(3 * 1024 * 1024 + 7, 5);
    c.put_object().bucket("open").key("k").body(data.clone().into()).send().await?;
    let out = client_of(&server.endpoint(), "someone-else", "x").get_object().bucket("open").key("k").send().await?;
    assert_eq!(out.body.collect().await?.into_bytes().as_ref(), data.as_slice());
    let listed = c.list_buckets().send().await?;
    assert_eq!(listed.buckets().len(), 1);
    let url = c
        .get_object()
        .bucket("open")
        .key("k")
        .presigned(PresigningConfig::expires_in(Duration::from_secs(300))?)
        .await?
        .uri()
        .to_owned();
    let got = reqwest::get(&url).await?;
    assert_eq!(got.status(), 200, "a presigned URL of an unknown key");
    assert_eq!(got.bytes().await?.len(), data.len());
    // Unsigned requests too, and no admin requests without an admin key.
    let plain = reqwest::get(format!("{}/open/k", server.endpoint())).await?;
    assert_eq!(plain.status(), 200);
    let (good, _, err) = run_cli(
        &["key", "create", "x", "--endpoint", &server.addr],
        &[("LIGHTNINGSTOR_ACCESS_KEY", "a"), ("LIGHTNINGSTOR_SECRET_KEY", "b")],
    );
    assert!(!good && err.contains("no admin key"), "{err}");
    Ok(())
}

fn lifecycle_rule(id: &str, prefix: Option<&str>) -> aws_sdk_s3::types::builders::LifecycleRuleBuilder {
    use aws_sdk_s3::types::{ExpirationStatus, LifecycleRule, LifecycleRuleFilter};
    let filter = match prefix {
        Some(p) => LifecycleRuleFilter::builder().prefix(p).build(),
        None => LifecycleRuleFilter::builder().build(),
    };
    LifecycleRule::builder().id(id).status(ExpirationStatus::Enabled).filter(filter)
}

fn expire_after(days: i32) -> aws_sdk_s3::types::LifecycleExpiration {
    aws_sdk_s3::types::LifecycleExpiration::builder().days(days).build()
}

fn abort_after(days: i32) -> aws_sdk_s3::types::AbortIncompleteMultipartUpload {
    aws_sdk_s3::types::AbortIncompleteMultipartUpload::builder().days_after_initiation(days).build()
}

async fn keys_of(c: &aws_sdk_s3::Client, b: &str) -> anyhow::Result<Vec<String>> {
    let out = c.list_objects_v2().bucket(b).send().await?;
    Ok(out.contents().iter().filter_map(|o| o.key().map(str::to_owned)).collect())
}

/// With a 1-second "day": objects under `tmp/` older than 3 days go, other
/// keys (`keep/`, and `tmpx`, which only looks alike) and a disabled rule's
/// keys stay, a fresh `tmp/` object stays; the multipart upload older than
/// 2 days is aborted. `counts` gives the nodes' (expired, aborted) counters,
/// summed: each object and upload is counted once, so handled once.
async fn rules_expire_old_objects_by_prefix_and_abort_old_uploads(
    c: aws_sdk_s3::Client,
    counts: impl Fn() -> (u64, u64),
) -> R {
    use aws_sdk_s3::types::{BucketLifecycleConfiguration, ExpirationStatus};
    c.create_bucket().bucket("life").send().await?;
    for k in ["tmp/a", "tmp/b", "tmp/c/d", "keep/a", "tmpx"] {
        put(&c, "life", k, b"old").await;
    }
    let up = c.create_multipart_upload().bucket("life").key("keep/big").send().await?;
    let id = up.upload_id().expect("upload id").to_owned();
    c.upload_part()
        .bucket("life")
        .key("keep/big")
        .upload_id(&id)
        .part_number(1)
        .body(ByteStream::from_static(b"part one"))
        .send()
        .await?;
    let config = BucketLifecycleConfiguration::builder()
        .rules(lifecycle_rule("tmp", Some("tmp/")).expiration(expire_after(3)).build()?)
        .rules(lifecycle_rule("uploads", None).abort_incomplete_multipart_upload(abort_after(2)).build()?)
        .rules(
            lifecycle_rule("off", Some("keep/"))
                .status(ExpirationStatus::Disabled)
                .expiration(expire_after(1))
                .build()?,
        )
        .build()?;
    c.put_bucket_lifecycle_configuration().bucket("life").lifecycle_configuration(config).send().await?;
    // Younger than their 3 "days": still there.
    c.head_object().bucket("life").key("tmp/a").send().await?;

    let deadline = std::time::Instant::now() + Duration::from_secs(40);
    loop {
        let keys = keys_of(&c, "life").await?;
        let uploads = c.list_multipart_uploads().bucket("life").send().await?.uploads().len();
        let (expired, aborted) = counts();
        if keys == ["keep/a", "tmpx"] && uploads == 0 && expired >= 3 && aborted >= 1 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "lifecycle did not act: keys {keys:?}, {uploads} uploads, counts {:?}",
            counts()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert_eq!(counts(), (3, 1), "each object and upload is handled once");
    let e = c.list_parts().bucket("life").key("keep/big").upload_id(&id).send().await.expect_err("aborted");
    assert_eq!(code(&e), "NoSuchUpload");
    // A fresh object under the prefix is not touched.
    put(&c, "life", "tmp/new", b"new").await;
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert_eq!(body_of(c.get_object().bucket("life").key("tmp/new").send().await?).await, b"new");
    assert_eq!(body_of(c.get_object().bucket("life").key("keep/a").send().await?).await, b"old");
    Ok(())
}

/// Put, get and delete round-trip the supported subset; rules with elements
/// outside it are NotImplemented (naming the element), bad values get S3's
/// errors, and neither replaces the stored configuration.
async fn lifecycle_configurations_round_trip_and_unsupported_rules_are_refused(c: aws_sdk_s3::Client) -> R {
    use aws_sdk_s3::types::{
        BucketLifecycleConfiguration, ExpirationStatus, LifecycleExpiration, LifecycleRule, LifecycleRuleAndOperator,
        LifecycleRuleFilter, Tag, Transition, TransitionStorageClass,
    };
    c.create_bucket().bucket("life").send().await?;
    let e = c.get_bucket_lifecycle_configuration().bucket("life").send().await.expect_err("none yet");
    assert_eq!((code(&e).as_str(), status(&e)), ("NoSuchLifecycleConfiguration", 404));
    let e = c.get_bucket_lifecycle_configuration().bucket("nope").send().await.expect_err("no bucket");
    assert_eq!(code(&e), "NoSuchBucket");

    // The legacy top-level Prefix (deprecated in the SDK, still accepted by S3).
    #[allow(deprecated)]
    let legacy = LifecycleRule::builder()
        .id("legacy")
        .status(ExpirationStatus::Disabled)
        .prefix("old/")
        .abort_incomplete_multipart_upload(abort_after(7))
        .build()?;
    let good = vec![
        lifecycle_rule("tmp", Some("tmp/")).expiration(expire_after(30)).build()?,
        lifecycle_rule("all", None)
            .expiration(expire_after(365))
            .abort_incomplete_multipart_upload(abort_after(1))
            .build()?,
        legacy,
    ];
    let config = BucketLifecycleConfiguration::builder().set_rules(Some(good.clone())).build()?;
    c.put_bucket_lifecycle_configuration().bucket("life").lifecycle_configuration(config).send().await?;
    let got = c.get_bucket_lifecycle_configuration().bucket("life").send().await?;
    assert_eq!(got.rules(), good.as_slice());

    let refused: Vec<(&str, LifecycleRule)> = vec![
        (
            "Tag",
            lifecycle_rule("t", None)
                .filter(LifecycleRuleFilter::builder().tag(Tag::builder().key("k").value("v").build()?).build())
                .expiration(expire_after(1))
                .build()?,
        ),
        (
            "And",
            lifecycle_rule("t", None)
                .filter(
                    LifecycleRuleFilter::builder()
                        .and(LifecycleRuleAndOperator::builder().prefix("a/").object_size_greater_than(5).build())
                        .build(),
                )
                .expiration(expire_after(1))
                .build()?,
        ),
        (
            "ObjectSizeGreaterThan",
            lifecycle_rule("t", None)
                .filter(LifecycleRuleFilter::builder().object_size_greater_than(10).build())
                .expiration(expire_after(1))
                .build()?,
        ),
        (
            "Date",
            lifecycle_rule("t", None)
                .expiration(LifecycleExpiration::builder().date(DateTime::from_secs(1_893_456_000)).build())
                .build()?,
        ),
        (
            "ExpiredObjectDeleteMarker",
            lifecycle_rule("t", None)
                .expiration(LifecycleExpiration::builder().expired_object_delete_marker(true).build())
                .build()?,
        ),
        (
            "Transition",
            lifecycle_rule("t", None)
                .transitions(Transition::builder().days(1).storage_class(TransitionStorageClass::Glacier).build())
                .build()?,
        ),
    ];
    for (what, rule) in refused {
        let config = BucketLifecycleConfiguration::builder().rules(rule).build()?;
        let e = c
            .put_bucket_lifecycle_configuration()
            .bucket("life")
            .lifecycle_configuration(config)
            .send()
            .await
            .expect_err(what);
        assert_eq!((code(&e).as_str(), status(&e)), ("NotImplemented", 501), "{what}");
        let msg = e.as_service_error().and_then(|s| aws_sdk_s3::error::ProvideErrorMetadata::message(s)).unwrap_or("");
        assert!(msg.contains(what), "{what}: {msg}");
    }
    let bad: Vec<(&str, Vec<LifecycleRule>)> = vec![
        ("InvalidArgument", vec![lifecycle_rule("zero", None).expiration(expire_after(0)).build()?]),
        (
            "InvalidArgument",
            vec![lifecycle_rule("neg", None).abort_incomplete_multipart_upload(abort_after(-1)).build()?],
        ),
        (
            "InvalidArgument",
            vec![
                lifecycle_rule("twice", None).expiration(expire_after(1)).build()?,
                lifecycle_rule("twice", Some("x")).expiration(expire_after(1)).build()?,
            ],
        ),
        ("InvalidRequest", vec![lifecycle_rule("no-action", None).build()?]),
    ];
    for (want, rules) in bad {
        let config = BucketLifecycleConfiguration::builder().set_rules(Some(rules)).build()?;
        let e = c
            .put_bucket_lifecycle_configuration()
            .bucket("life")
            .lifecycle_configuration(config)
            .send()
            .await
            .expect_err(want);
        assert_eq!(code(&e), want);
    }
    let too_many: Vec<LifecycleRule> = (0..1001)
        .map(|i| lifecycle_rule(&i.to_string(), None).expiration(expire_after(1)).build())
        .collect::<Result<_, _>>()?;
    let config = BucketLifecycleConfiguration::builder().set_rules(Some(too_many)).build()?;
    let e = c
        .put_bucket_lifecycle_configuration()
        .bucket("life")
        .lifecycle_configuration(config)
        .send()
        .await
        .expect_err("1001");
    assert_eq!(code(&e), "MalformedXML");
    // Nothing refused replaced the configuration.
    let got = c.get_bucket_lifecycle_configuration().bucket("life").send().await?;
    assert_eq!(got.rules(), good.as_slice());

    c.delete_bucket_lifecycle().bucket("life").send().await?;
    let e = c.get_bucket_lifecycle_configuration().bucket("life").send().await.expect_err("deleted");
    assert_eq!(code(&e), "NoSuchLifecycleConfiguration");
    c.delete_bucket_lifecycle().bucket("life").send().await?;
    Ok(())
}

/// A key with read and write on a bucket, but not owner, may neither put,
/// get nor delete its lifecycle configuration (AccessDenied, nothing
/// stored); once it owns the bucket it may.
async fn lifecycle_needs_the_owner_permission(
    admin: aws_sdk_s3::Client,
    kr: std::sync::Arc<dyn lightningstor::keys::Keyring>,
    client_for: impl Fn(&str, &str) -> aws_sdk_s3::Client,
) -> R {
    use aws_sdk_s3::types::BucketLifecycleConfiguration;
    use lightningstor::keys::{self, Perms};
    admin.create_bucket().bucket("life").send().await?;
    let (id, key) = keys::create_key(&*kr, "bob").await?;
    keys::change_grant(&*kr, "life", &id, Perms::READ.union(Perms::WRITE), Perms::NONE).await?;
    let bob = client_for(&id, &key.secret);
    put(&bob, "life", "k", b"v").await;
    let config = || {
        BucketLifecycleConfiguration::builder()
            .rules(lifecycle_rule("all", None).expiration(expire_after(1)).build().expect("rule"))
            .build()
            .expect("config")
    };
    let e = bob
        .put_bucket_lifecycle_configuration()
        .bucket("life")
        .lifecycle_configuration(config())
        .send()
        .await
        .expect_err("put");
    assert_eq!(code(&e), "AccessDenied");
    let e = bob.get_bucket_lifecycle_configuration().bucket("life").send().await.expect_err("get");
    assert_eq!(code(&e), "AccessDenied");
    let e = bob.delete_bucket_lifecycle().bucket("life").send().await.expect_err("delete");
    assert_eq!(code(&e), "AccessDenied");
    let e = admin.get_bucket_lifecycle_configuration().bucket("life").send().await.expect_err("nothing stored");
    assert_eq!(code(&e), "NoSuchLifecycleConfiguration");

    keys::change_grant(&*kr, "life", &id, Perms::OWNER, Perms::NONE).await?;
    bob.put_bucket_lifecycle_configuration().bucket("life").lifecycle_configuration(config()).send().await?;
    assert_eq!(bob.get_bucket_lifecycle_configuration().bucket("life").send().await?.rules().len(), 1);
    bob.delete_bucket_lifecycle().bucket("life").send().await?;
    Ok(())
}

/// Bucket versioning, on a single node (in process, and across a restart of
/// the binary) and on a 3-node cluster (whose replicas keep the versions:
/// `cluster::versions`); both answer a bucket that never had versioning
/// without version ids.
mod versioning {
    use super::*;

    #[tokio::test]
    async fn versions_are_kept_read_listed_and_deleted_single_node() -> R {
        let _gate = crate::gate::shared();
        let s = InProcess::new();
        super::versions_are_kept_read_listed_and_deleted(s.client()).await
    }

    #[tokio::test]
    async fn suspended_versioning_writes_and_replaces_the_null_version_single_node() -> R {
        let _gate = crate::gate::shared();
        let s = InProcess::new();
        super::suspended_versioning_writes_and_replaces_the_null_version(s.client()).await
    }

    #[tokio::test]
    async fn a_version_deleted_for_good_frees_the_blocks_no_other_version_uses_single_node() -> R {
        let _gate = crate::gate::shared();
        let s = InProcess::new();
        super::a_version_deleted_for_good_frees_the_blocks_no_other_version_uses(s.client(), s.dir.path()).await
    }

    #[tokio::test]
    async fn a_bucket_without_versioning_answers_no_version_ids_single_node() -> R {
        let _gate = crate::gate::shared();
        let s = InProcess::new();
        super::a_bucket_without_versioning_answers_no_version_ids(s.client()).await
    }

    #[tokio::test]
    async fn a_bucket_without_versioning_answers_no_version_ids_three_node_cluster() -> R {
        let _gate = crate::gate::shared();
        let s = InCluster::new(3);
        super::a_bucket_without_versioning_answers_no_version_ids(s.client()).await
    }

    #[tokio::test]
    async fn versions_are_kept_read_listed_and_deleted_three_node_cluster() -> R {
        let _gate = crate::gate::shared();
        let s = InCluster::new(3);
        super::versions_are_kept_read_listed_and_deleted(s.client()).await
    }

    #[tokio::test]
    async fn suspended_versioning_writes_and_replaces_the_null_version_three_node_cluster() -> R {
        let _gate = crate::gate::shared();
        let s = InCluster::new(3);
        super::suspended_versioning_writes_and_replaces_the_null_version(s.client()).await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn versions_and_delete_markers_survive_a_restart_single_node() -> R {
        let _gate = crate::gate::shared();
        let dir = tempfile::tempdir()?;
        let server = Spawned::start(dir.path(), &[]);
        let c = server.client();
        c.create_bucket().bucket("bkt").send().await?;
        c.put_bucket_versioning().bucket("bkt").versioning_configuration(super::enabled()).send().await?;
        let v1 = super::put_version(&c, "bkt", "k", b"one").await;
        let v2 = super::put_version(&c, "bkt", "k", b"two").await;
        let marker = c.delete_object().bucket("bkt").key("k").send().await?;
        assert_eq!(marker.delete_marker(), Some(true));
        server.stop();

        let server = Spawned::start(dir.path(), &[]);
        let c = server.client();
        let got = c.get_bucket_versioning().bucket("bkt").send().await?;
        assert_eq!(got.status(), Some(&aws_sdk_s3::types::BucketVersioningStatus::Enabled));
        let e = c.get_object().bucket("bkt").key("k").send().await.expect_err("a delete marker is latest");
        assert_eq!(code(&e), "NoSuchKey");
        for (v, want) in [(&v1, b"one"), (&v2, b"two")] {
            let got = c.get_object().bucket("bkt").key("k").version_id(v).send().await?;
            assert_eq!(got.version_id(), Some(v.as_str()));
            assert_eq!(body_of(got).await, want);
        }
        let list = c.list_object_versions().bucket("bkt").send().await?;
        assert_eq!(list.versions().len(), 2);
        assert_eq!(list.delete_markers().len(), 1);
        assert_eq!(list.delete_markers()[0].version_id(), marker.version_id());
        Ok(())
    }
}

fn enabled() -> aws_sdk_s3::types::VersioningConfiguration {
    use aws_sdk_s3::types::{BucketVersioningStatus, VersioningConfiguration};
    VersioningConfiguration::builder().status(BucketVersioningStatus::Enabled).build()
}

fn suspended() -> aws_sdk_s3::types::VersioningConfiguration {
    use aws_sdk_s3::types::{BucketVersioningStatus, VersioningConfiguration};
    VersioningConfiguration::builder().status(BucketVersioningStatus::Suspended).build()
}

/// PUTs `data` and returns the version id it got.
async fn put_version(c: &aws_sdk_s3::Client, b: &str, k: &str, data: &[u8]) -> String {
    let out = c.put_object().bucket(b).key(k).body(ByteStream::from(data.to_vec())).send().await.expect("put");
    out.version_id.expect("a versioned PUT answers a version id")
}

/// The header of a failed SDK call's reply.
fn error_header<E>(
    e: &aws_sdk_s3::error::SdkError<E, aws_sdk_s3::config::http::HttpResponse>,
    name: &str,
) -> Option<String> {
    e.raw_response().and_then(|r| r.headers().get(name)).map(str::to_owned)
}

/// (key, version id, is latest, is a delete marker) of every entry of a
/// version listing, versions and markers merged in listing order (key, then
/// newest first: ids grow with time, so descending).
fn version_rows(
    out: &aws_sdk_s3::operation::list_object_versions::ListObjectVersionsOutput,
) -> Vec<(String, String, bool, bool)> {
    let mut rows: Vec<_> = out
        .versions()
        .iter()
        .map(|v| {
            (
                v.key().unwrap_or("").to_owned(),
                v.version_id().unwrap_or("").to_owned(),
                v.is_latest() == Some(true),
                false,
            )
        })
        .chain(out.delete_markers().iter().map(|m| {
            (
                m.key().unwrap_or("").to_owned(),
                m.version_id().unwrap_or("").to_owned(),
                m.is_latest() == Some(true),
                true,
            )
        }))
        .collect();
    rows.sort_by(|a, b| a.0.cmp(&b.0).then_with(|| b.2.cmp(&a.2)).then_with(|| b.1.cmp(&a.1)));
    rows
}

/// Enabled versioning: every PUT, copy and completed upload is a new
/// version; GET/HEAD read the latest or the version named; a DELETE leaves a
/// delete marker (GET then 404 with x-amz-delete-marker, the marker's id
/// 405); deleting a version for good brings the next newest back;
/// ListObjects shows only latest objects, ListObjectVersions everything and
/// pages by key and version markers; conditions apply to the latest; a
/// bucket holding versions cannot be deleted; MFA delete is refused.
async fn versions_are_kept_read_listed_and_deleted(c: aws_sdk_s3::Client) -> R {
    use aws_sdk_s3::types::{BucketVersioningStatus, MfaDelete, VersioningConfiguration};
    c.create_bucket().bucket("bkt").send().await?;
    put(&c, "bkt", "pre", b"before versioning").await;
    assert_eq!(c.get_bucket_versioning().bucket("bkt").send().await?.status(), None);
    let mfa = VersioningConfiguration::builder()
        .status(BucketVersioningStatus::Enabled)
        .mfa_delete(MfaDelete::Enabled)
        .build();
    let e = c.put_bucket_versioning().bucket("bkt").versioning_configuration(mfa).send().await.expect_err("mfa");
    assert_eq!(code(&e), "NotImplemented");
    assert_eq!(c.get_bucket_versioning().bucket("bkt").send().await?.status(), None, "a refused change changed");
    c.put_bucket_versioning().bucket("bkt").versioning_configuration(enabled()).send().await?;
    let got = c.get_bucket_versioning().bucket("bkt").send().await?;
    assert_eq!(got.status(), Some(&BucketVersioningStatus::Enabled));

    let v1 = put_version(&c, "bkt", "k", b"one").await;
    let v2 = put_version(&c, "bkt", "k", b"two").await;
    assert_ne!(v1, v2);
    assert_ne!(v1, "null");
    let got = c.get_object().bucket("bkt").key("k").send().await?;
    assert_eq!(got.version_id(), Some(v2.as_str()));
    assert_eq!(body_of(got).await, b"two");
    let got = c.get_object().bucket("bkt").key("k").version_id(&v1).send().await?;
    assert_eq!(got.version_id(), Some(v1.as_str()));
    assert_eq!(body_of(got).await, b"one");
    let head = c.head_object().bucket("bkt").key("k").version_id(&v1).send().await?;
    assert_eq!((head.content_length(), head.version_id()), (Some(3), Some(v1.as_str())));
    // The object from before versioning is the null version.
    let got = c.get_object().bucket("bkt").key("pre").version_id("null").send().await?;
    assert_eq!(got.version_id(), Some("null"));
    assert_eq!(body_of(got).await, b"before versioning");
    let e = c.get_object().bucket("bkt").key("k").version_id("00000000000000ff").send().await.expect_err("unknown");
    assert_eq!((code(&e).as_str(), status(&e)), ("NoSuchVersion", 404));
    let e = c.get_object().bucket("bkt").key("k").version_id("not-a-version").send().await.expect_err("garbage");
    assert_eq!(code(&e), "InvalidArgument");

    // Conditional writes apply to the latest version.
    let e = c
        .put_object()
        .bucket("bkt")
        .key("k")
        .if_match(format!("\"{}\"", hex::encode(md5::Md5::digest(b"one"))))
        .body(ByteStream::from_static(b"x"))
        .send()
        .await
        .expect_err("If-Match of an older version");
    assert_eq!(status(&e), 412);
    let e = c.put_object().bucket("bkt").key("k").if_none_match("*").body(ByteStream::from_static(b"x")).send().await;
    assert_eq!(status(&e.expect_err("If-None-Match on an existing key")), 412);
    let v3 = c
        .put_object()
        .bucket("bkt")
        .key("k")
        .if_match(format!("\"{}\"", hex::encode(md5::Md5::digest(b"two"))))
        .body(ByteStream::from_static(b"three"))
        .send()
        .await?
        .version_id
        .expect("version id");

    // A copy of a version, and a completed multipart upload, are versions.
    let copy = c.copy_object().bucket("bkt").key("copy").copy_source(format!("bkt/k?versionId={v1}")).send().await?;
    assert_eq!(copy.copy_source_version_id(), Some(v1.as_str()));
    let vc = copy.version_id().expect("copy version").to_owned();
    assert_eq!(body_of(c.get_object().bucket("bkt").key("copy").send().await?).await, b"one");
    let up = c.create_multipart_upload().bucket("bkt").key("mp").send().await?;
    let id = up.upload_id().expect("id");
    let part = c
        .upload_part()
        .bucket("bkt")
        .key("mp")
        .upload_id(id)
        .part_number(1)
        .body(ByteStream::from_static(b"part"))
        .send()
        .await?;
    let parts = CompletedMultipartUpload::builder()
        .parts(CompletedPart::builder().part_number(1).e_tag(part.e_tag().expect("etag")).build())
        .build();
    let done =
        c.complete_multipart_upload().bucket("bkt").key("mp").upload_id(id).multipart_upload(parts).send().await?;
    let vm = done.version_id().expect("a completed upload is a version").to_owned();
    assert_eq!(c.head_object().bucket("bkt").key("mp").send().await?.version_id(), Some(vm.as_str()));

    // A DELETE without a version id leaves a delete marker.
    let del = c.delete_object().bucket("bkt").key("k").send().await?;
    assert_eq!(del.delete_marker(), Some(true));
    let marker = del.version_id().expect("marker id").to_owned();
    let e = c.get_object().bucket("bkt").key("k").send().await.expect_err("latest is a marker");
    assert_eq!((code(&e).as_str(), status(&e)), ("NoSuchKey", 404));
    assert_eq!(error_header(&e, "x-amz-delete-marker").as_deref(), Some("true"));
    assert_eq!(error_header(&e, "x-amz-version-id").as_deref(), Some(marker.as_str()));
    let e = c.head_object().bucket("bkt").key("k").send().await.expect_err("HEAD of a marker");
    assert_eq!(status(&e), 404);
    let e = c.get_object().bucket("bkt").key("k").version_id(&marker).send().await.expect_err("the marker by id");
    assert_eq!(status(&e), 405);
    assert_eq!(error_header(&e, "x-amz-delete-marker").as_deref(), Some("true"));
    // Older versions are still there.
    assert_eq!(body_of(c.get_object().bucket("bkt").key("k").version_id(&v2).send().await?).await, b"two");

    // ListObjects shows the latest objects only; ListObjectVersions all.
    let keys: Vec<_> = c
        .list_objects_v2()
        .bucket("bkt")
        .send()
        .await?
        .contents()
        .iter()
        .filter_map(|o| o.key().map(str::to_owned))
        .collect();
    assert_eq!(keys, ["copy", "mp", "pre"]);
    let all = c.list_object_versions().bucket("bkt").send().await?;
    let rows = version_rows(&all);
    let want = [
        ("copy", vc.as_str(), true, false),
        ("k", marker.as_str(), true, true),
        ("k", v3.as_str(), false, false),
        ("k", v2.as_str(), false, false),
        ("k", v1.as_str(), false, false),
        ("mp", vm.as_str(), true, false),
        ("pre", "null", true, false),
    ];
    let want: Vec<_> = want.iter().map(|(k, v, l, m)| ((*k).to_owned(), (*v).to_owned(), *l, *m)).collect();
    assert_eq!(rows, want);
    assert_eq!(all.is_truncated(), Some(false));
    let k_versions = c.list_object_versions().bucket("bkt").prefix("k").send().await?;
    assert_eq!(k_versions.versions().len() + k_versions.delete_markers().len(), 4);
    // Pages of 2, by key and version-id markers, give the same entries.
    let mut paged = Vec::new();
    let (mut km, mut vm_) = (None::<String>, None::<String>);
    for _ in 0..10 {
        let mut req = c.list_object_versions().bucket("bkt").max_keys(2);
        if let Some(k) = &km {
            req = req.key_marker(k);
        }
        if let Some(v) = &vm_ {
            req = req.version_id_marker(v);
        }
        let page = req.send().await?;
        assert!(page.versions().len() + page.delete_markers().len() <= 2);
        paged.extend(version_rows(&page));
        if page.is_truncated() != Some(true) {
            break;
        }
        km = page.next_key_marker().map(str::to_owned);
        vm_ = page.next_version_id_marker().map(str::to_owned);
    }
    assert_eq!(paged, want);
    let grouped = c.list_object_versions().bucket("bkt").delimiter("p").send().await?;
    let prefixes: Vec<_> = grouped.common_prefixes().iter().filter_map(|p| p.prefix()).collect();
    assert_eq!(prefixes, ["cop", "mp", "p"]);
    assert_eq!(version_rows(&grouped), want[1..5]);

    // A bucket holding versions is not empty.
    let e = c.delete_bucket().bucket("bkt").send().await.expect_err("versions left");
    assert_eq!(code(&e), "BucketNotEmpty");

    // Deleting the marker for good brings the version below it back.
    let del = c.delete_object().bucket("bkt").key("k").version_id(&marker).send().await?;
    assert_eq!((del.delete_marker(), del.version_id()), (Some(true), Some(marker.as_str())));
    let got = c.get_object().bucket("bkt").key("k").send().await?;
    assert_eq!(got.version_id(), Some(v3.as_str()));
    // Deleting the latest version for good makes the next newest current.
    c.delete_object().bucket("bkt").key("k").version_id(&v3).send().await?;
    let got = c.get_object().bucket("bkt").key("k").send().await?;
    assert_eq!(got.version_id(), Some(v2.as_str()));
    assert_eq!(body_of(got).await, b"two");
    let e = c.get_object().bucket("bkt").key("k").version_id(&v3).send().await.expect_err("gone for good");
    assert_eq!(code(&e), "NoSuchVersion");

    // DeleteObjects: a version for good, and a key (a new marker).
    let batch = Delete::builder()
        .objects(ObjectIdentifier::builder().key("k").version_id(&v1).build()?)
        .objects(ObjectIdentifier::builder().key("copy").build()?)
        .objects(ObjectIdentifier::builder().key("mp").version_id("garbage").build()?)
        .build()?;
    let out = c.delete_objects().bucket("bkt").delete(batch).send().await?;
    let deleted = out.deleted();
    assert_eq!(deleted.len(), 2);
    let by_key = |k: &str| deleted.iter().find(|d| d.key() == Some(k)).expect("deleted entry");
    assert_eq!((by_key("k").version_id(), by_key("k").delete_marker()), (Some(v1.as_str()), None));
    assert_eq!(by_key("copy").delete_marker(), Some(true));
    assert!(by_key("copy").delete_marker_version_id().is_some());
    assert_eq!(out.errors().len(), 1);
    assert_eq!(out.errors()[0].code(), Some("InvalidArgument"));
    let e = c.get_object().bucket("bkt").key("k").version_id(&v1).send().await.expect_err("v1 deleted");
    assert_eq!(code(&e), "NoSuchVersion");
    assert_eq!(body_of(c.get_object().bucket("bkt").key("k").send().await?).await, b"two");
    let e = c.get_object().bucket("bkt").key("copy").send().await.expect_err("copy has a marker");
    assert_eq!(code(&e), "NoSuchKey");
    assert_eq!(body_of(c.get_object().bucket("bkt").key("copy").version_id(&vc).send().await?).await, b"one");
    Ok(())
}

/// Suspended versioning: new writes get the version id `null` and replace
/// the null version; versions made while enabled stay; a DELETE leaves a
/// `null` delete marker.
async fn suspended_versioning_writes_and_replaces_the_null_version(c: aws_sdk_s3::Client) -> R {
    use aws_sdk_s3::types::BucketVersioningStatus;
    c.create_bucket().bucket("bkt").send().await?;
    c.put_bucket_versioning().bucket("bkt").versioning_configuration(enabled()).send().await?;
    let v1 = put_version(&c, "bkt", "k", b"one").await;
    c.put_bucket_versioning().bucket("bkt").versioning_configuration(suspended()).send().await?;
    let got = c.get_bucket_versioning().bucket("bkt").send().await?;
    assert_eq!(got.status(), Some(&BucketVersioningStatus::Suspended));
    assert_eq!(put_version(&c, "bkt", "k", b"two").await, "null");
    assert_eq!(put_version(&c, "bkt", "k", b"three").await, "null");
    let rows = version_rows(&c.list_object_versions().bucket("bkt").send().await?);
    let want: Vec<_> = [("k", "null", true, false), ("k", v1.as_str(), false, false)]
        .iter()
        .map(|(k, v, l, m)| ((*k).to_owned(), (*v).to_owned(), *l, *m))
        .collect();
    assert_eq!(rows, want, "the second null write replaced the first");
    assert_eq!(body_of(c.get_object().bucket("bkt").key("k").version_id("null").send().await?).await, b"three");
    let del = c.delete_object().bucket("bkt").key("k").send().await?;
    assert_eq!((del.delete_marker(), del.version_id()), (Some(true), Some("null")));
    let out = c.list_object_versions().bucket("bkt").send().await?;
    assert_eq!(out.versions().len(), 1, "the null object was replaced by the null marker");
    assert_eq!(out.versions()[0].version_id(), Some(v1.as_str()));
    assert_eq!(out.delete_markers().len(), 1);
    assert_eq!(body_of(c.get_object().bucket("bkt").key("k").version_id(&v1).send().await?).await, b"one");
    Ok(())
}

/// Versions share blocks by content; a version deleted for good frees only
/// the blocks no other version (or current object) uses.
async fn a_version_deleted_for_good_frees_the_blocks_no_other_version_uses(
    c: aws_sdk_s3::Client,
    dir: &std::path::Path,
) -> R {
    c.create_bucket().bucket("bkt").send().await?;
    c.put_bucket_versioning().bucket("bkt").versioning_configuration(enabled()).send().await?;
    let (a, b) = (pseudo_random(64 * 1024, 1), pseudo_random(64 * 1024, 2));
    let va = put_version(&c, "bkt", "k", &a).await;
    let vb = put_version(&c, "bkt", "k", &b).await;
    let v_same = put_version(&c, "bkt", "other", &a).await;
    let before = block_files(dir).len();
    assert!(before >= 2, "two distinct bodies are blocks");
    // A delete marker frees nothing.
    c.delete_object().bucket("bkt").key("k").send().await?;
    assert_eq!(block_files(dir).len(), before);
    // `a` is still used by `other`: nothing freed.
    c.delete_object().bucket("bkt").key("k").version_id(&va).send().await?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(block_files(dir).len(), before);
    assert_eq!(body_of(c.get_object().bucket("bkt").key("other").version_id(&v_same).send().await?).await, a);
    // `b` is used by no other version: its blocks go.
    c.delete_object().bucket("bkt").key("k").version_id(&vb).send().await?;
    let mut left = block_files(dir).len();
    for _ in 0..50 {
        if left < before {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        left = block_files(dir).len();
    }
    assert!(left < before, "blocks of a version deleted for good are freed ({left} of {before} left)");
    assert_eq!(body_of(c.get_object().bucket("bkt").key("other").send().await?).await, a);
    Ok(())
}

/// A bucket that never had versioning answers as before: no version ids,
/// no delete markers, and the null version is its current object.
async fn a_bucket_without_versioning_answers_no_version_ids(c: aws_sdk_s3::Client) -> R {
    c.create_bucket().bucket("bkt").send().await?;
    let out = c.put_object().bucket("bkt").key("k").body(ByteStream::from_static(b"v")).send().await?;
    assert_eq!(out.version_id(), None);
    let got = c.get_object().bucket("bkt").key("k").send().await?;
    assert_eq!(got.version_id(), None);
    assert_eq!(c.head_object().bucket("bkt").key("k").send().await?.version_id(), None);
    let copy = c.copy_object().bucket("bkt").key("k2").copy_source("bkt/k").send().await?;
    assert_eq!(copy.version_id(), None);
    let del = c.delete_object().bucket("bkt").key("k2").send().await?;
    assert_eq!((del.delete_marker(), del.version_id()), (None, None));
    let e = c.get_object().bucket("bkt").key("k2").send().await.expect_err("deleted");
    assert_eq!(code(&e), "NoSuchKey");
    assert_eq!(error_header(&e, "x-amz-delete-marker"), None);
    let e = c.get_object().bucket("bkt").key("k").version_id("v2").send().await.expect_err("not an id");
    assert_eq!(code(&e), "InvalidArgument");
    c.delete_object().bucket("bkt").key("k").version_id("null").send().await?;
    let e = c.head_object().bucket("bkt").key("k").send().await.expect_err("the null version was deleted");
    assert_eq!(status(&e), 404);
    c.delete_bucket().bucket("bkt").send().await?;
    Ok(())
}
