//! Request options this server does not implement are refused, not ignored.
//!
//! s3s parses every header and query parameter of an operation into its
//! input struct; a handler that only reads the fields it implements would
//! silently drop the rest. For most fields that is a wrong answer (a GET of
//! `versionId=X` returning the current object), and for server-side
//! encryption it is a security bug: a PUT with an SSE-C key would store the
//! plaintext and a GET without the key would return it. So before a handler
//! runs, [`Supported::check_supported`] looks at every option of its input
//! that no handler implements and answers `NotImplemented` naming it.
//!
//! The one front end (`LightningS3`, over the local store on a single node
//! and over the coordinator on a cluster node) calls it, so both modes
//! refuse the same things (SSE-C is served,
//! SSE-KMS and SSE-S3 are refused); the tests in
//! `tests/it/s3/api.rs` run against both.

use crate::error::{LightningError, Result};
use s3s::dto::*;

/// An operation's input that can say whether it asks for something we do not do.
pub(crate) trait Supported {
    /// `Err(NotImplemented)` naming the first option of `self` this server
    /// does not implement; `Ok(())` otherwise.
    fn check_supported(&self) -> Result<()>;
}

fn refuse(what: &str) -> Result<()> {
    Err(LightningError::NotImplemented(format!("{what} is not supported by this server")))
}

/// Storage classes other than STANDARD.
fn storage_class(c: Option<&StorageClass>) -> Result<()> {
    match c {
        Some(c) if c.as_str() != StorageClass::STANDARD => refuse("x-amz-storage-class other than STANDARD"),
        _ => Ok(()),
    }
}

/// Canned ACLs other than `private` (every object and bucket is private to the owner).
fn acl(a: Option<&str>) -> Result<()> {
    match a {
        Some(a) if a != "private" => refuse("x-amz-acl other than private"),
        _ => Ok(()),
    }
}

/// Refuses the first `Some` among the named optional fields of `$i`, with
/// its header name in the message.
macro_rules! refuse_some {
    ($i:expr; $($field:ident => $name:literal),* $(,)?) => {
        $( if $i.$field.is_some() { return refuse($name); } )*
    };
}

/// The SSE-KMS and SSE-S3 request headers.
macro_rules! sse_kms_s3 {
    ($i:expr) => {
        refuse_some!($i;
            server_side_encryption => "x-amz-server-side-encryption (SSE-S3/SSE-KMS)",
            ssekms_key_id => "x-amz-server-side-encryption-aws-kms-key-id (SSE-KMS)",
            ssekms_encryption_context => "x-amz-server-side-encryption-context (SSE-KMS)",
            bucket_key_enabled => "x-amz-server-side-encryption-bucket-key-enabled (SSE-KMS)",
        );
    };
}

/// Grants, object lock, tagging, website redirects: object options we do not keep.
macro_rules! object_options {
    ($i:expr) => {
        refuse_some!($i;
            grant_full_control => "x-amz-grant-full-control",
            grant_read => "x-amz-grant-read",
            grant_read_acp => "x-amz-grant-read-acp",
            grant_write_acp => "x-amz-grant-write-acp",
            object_lock_mode => "x-amz-object-lock-mode (object lock)",
            object_lock_retain_until_date => "x-amz-object-lock-retain-until-date (object lock)",
            object_lock_legal_hold_status => "x-amz-object-lock-legal-hold (object lock)",
            tagging => "x-amz-tagging (object tags)",
            website_redirect_location => "x-amz-website-redirect-location",
            expected_bucket_owner => "x-amz-expected-bucket-owner",
        );
        acl($i.acl.as_ref().map(|a| a.as_str()))?;
        storage_class($i.storage_class.as_ref())?;
    };
}

impl Supported for PutObjectInput {
    fn check_supported(&self) -> Result<()> {
        // SSE-C is implemented (`crate::sse`); SSE-KMS and SSE-S3 are not.
        sse_kms_s3!(self);
        object_options!(self);
        refuse_some!(self; write_offset_bytes => "x-amz-write-offset-bytes (appends)");
        Ok(())
    }
}

impl Supported for CopyObjectInput {
    fn check_supported(&self) -> Result<()> {
        // SSE-C on the source and the destination is implemented.
        sse_kms_s3!(self);
        object_options!(self);
        refuse_some!(self;
            expected_source_bucket_owner => "x-amz-source-expected-bucket-owner",
        );
        if self.tagging_directive.as_ref().is_some_and(|d| d.as_str() != TaggingDirective::COPY) {
            return refuse("x-amz-tagging-directive REPLACE (object tags)");
        }
        Ok(())
    }
}

impl Supported for CreateMultipartUploadInput {
    fn check_supported(&self) -> Result<()> {
        sse_kms_s3!(self);
        object_options!(self);
        Ok(())
    }
}

impl Supported for UploadPartInput {
    fn check_supported(&self) -> Result<()> {
        refuse_some!(self; expected_bucket_owner => "x-amz-expected-bucket-owner");
        Ok(())
    }
}

impl Supported for UploadPartCopyInput {
    fn check_supported(&self) -> Result<()> {
        refuse_some!(self;
            expected_bucket_owner => "x-amz-expected-bucket-owner",
            expected_source_bucket_owner => "x-amz-source-expected-bucket-owner",
        );
        Ok(())
    }
}

impl Supported for CompleteMultipartUploadInput {
    fn check_supported(&self) -> Result<()> {
        refuse_some!(self;
            expected_bucket_owner => "x-amz-expected-bucket-owner",
            mpu_object_size => "x-amz-mp-object-size",
        );
        Ok(())
    }
}

impl Supported for GetObjectInput {
    fn check_supported(&self) -> Result<()> {
        refuse_some!(self; expected_bucket_owner => "x-amz-expected-bucket-owner");
        Ok(())
    }
}

impl Supported for HeadObjectInput {
    fn check_supported(&self) -> Result<()> {
        refuse_some!(self; expected_bucket_owner => "x-amz-expected-bucket-owner");
        Ok(())
    }
}

impl Supported for DeleteObjectInput {
    fn check_supported(&self) -> Result<()> {
        refuse_some!(self;
            bypass_governance_retention => "x-amz-bypass-governance-retention (object lock)",
            mfa => "x-amz-mfa (MFA delete)",
            expected_bucket_owner => "x-amz-expected-bucket-owner",
        );
        Ok(())
    }
}

impl Supported for DeleteObjectsInput {
    fn check_supported(&self) -> Result<()> {
        refuse_some!(self;
            bypass_governance_retention => "x-amz-bypass-governance-retention (object lock)",
            mfa => "x-amz-mfa (MFA delete)",
            expected_bucket_owner => "x-amz-expected-bucket-owner",
        );
        Ok(())
    }
}

impl Supported for CreateBucketInput {
    fn check_supported(&self) -> Result<()> {
        refuse_some!(self;
            grant_full_control => "x-amz-grant-full-control",
            grant_read => "x-amz-grant-read",
            grant_read_acp => "x-amz-grant-read-acp",
            grant_write => "x-amz-grant-write",
            grant_write_acp => "x-amz-grant-write-acp",
        );
        if self.object_lock_enabled_for_bucket == Some(true) {
            return refuse("x-amz-bucket-object-lock-enabled (object lock)");
        }
        acl(self.acl.as_ref().map(|a| a.as_str()))
    }
}

impl Supported for PutBucketLifecycleConfigurationInput {
    fn check_supported(&self) -> Result<()> {
        refuse_some!(self;
            expected_bucket_owner => "x-amz-expected-bucket-owner",
            transition_default_minimum_object_size => "x-amz-transition-default-minimum-object-size",
        );
        Ok(())
    }
}

impl Supported for GetBucketLifecycleConfigurationInput {
    fn check_supported(&self) -> Result<()> {
        refuse_some!(self; expected_bucket_owner => "x-amz-expected-bucket-owner");
        Ok(())
    }
}

impl Supported for DeleteBucketLifecycleInput {
    fn check_supported(&self) -> Result<()> {
        refuse_some!(self; expected_bucket_owner => "x-amz-expected-bucket-owner");
        Ok(())
    }
}

/// Inputs whose only option we do not implement is
/// `x-amz-expected-bucket-owner` (there are no account ids to compare it
/// with, so honouring it is impossible and ignoring it would answer a
/// request the client meant to fail). `x-amz-request-payer` is accepted
/// and has no effect: no bucket here is a Requester Pays bucket.
macro_rules! only_owner_refused {
    ($($t:ty),* $(,)?) => {
        $( impl Supported for $t {
            fn check_supported(&self) -> Result<()> {
                refuse_some!(self; expected_bucket_owner => "x-amz-expected-bucket-owner");
                Ok(())
            }
        } )*
    };
}

only_owner_refused!(
    HeadBucketInput,
    DeleteBucketInput,
    GetBucketLocationInput,
    ListMultipartUploadsInput,
    GetBucketVersioningInput
);

/// MFA delete is not implemented (no MFA devices here).
impl Supported for PutBucketVersioningInput {
    fn check_supported(&self) -> Result<()> {
        refuse_some!(self;
            expected_bucket_owner => "x-amz-expected-bucket-owner",
            mfa => "x-amz-mfa (MFA delete)",
        );
        if self.versioning_configuration.mfa_delete.as_ref().is_some_and(|m| m.as_str() == MFADelete::ENABLED) {
            return refuse("MfaDelete Enabled (MFA delete)");
        }
        Ok(())
    }
}

impl Supported for ListObjectVersionsInput {
    fn check_supported(&self) -> Result<()> {
        refuse_some!(self;
            expected_bucket_owner => "x-amz-expected-bucket-owner",
            optional_object_attributes => "x-amz-optional-object-attributes",
        );
        Ok(())
    }
}

/// `OptionalObjectAttributes` (RestoreStatus of archived objects, which
/// this server does not have).
impl Supported for ListObjectsInput {
    fn check_supported(&self) -> Result<()> {
        refuse_some!(self;
            expected_bucket_owner => "x-amz-expected-bucket-owner",
            optional_object_attributes => "x-amz-optional-object-attributes",
        );
        Ok(())
    }
}

impl Supported for ListObjectsV2Input {
    fn check_supported(&self) -> Result<()> {
        refuse_some!(self;
            expected_bucket_owner => "x-amz-expected-bucket-owner",
            optional_object_attributes => "x-amz-optional-object-attributes",
        );
        Ok(())
    }
}

impl Supported for AbortMultipartUploadInput {
    fn check_supported(&self) -> Result<()> {
        refuse_some!(self;
            expected_bucket_owner => "x-amz-expected-bucket-owner",
            if_match_initiated_time => "x-amz-if-match-initiated-time",
        );
        Ok(())
    }
}

impl Supported for ListPartsInput {
    fn check_supported(&self) -> Result<()> {
        refuse_some!(self; expected_bucket_owner => "x-amz-expected-bucket-owner");
        Ok(())
    }
}

/// ListBuckets: every option (prefix, bucket-region, max-buckets,
/// continuation-token) is served by `bucket::bucket_page`.
impl Supported for ListBucketsInput {
    fn check_supported(&self) -> Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn put() -> PutObjectInput {
        PutObjectInput::builder().bucket("b".into()).key("k".into()).build().unwrap()
    }

    fn not_implemented(r: Result<()>) -> String {
        match r {
            Err(LightningError::NotImplemented(m)) => m,
            other => panic!("expected NotImplemented, got {other:?}"),
        }
    }

    #[test]
    fn a_plain_or_sse_c_put_is_supported_and_sse_kms_and_s3_are_refused() {
        assert!(put().check_supported().is_ok());
        let mut i = put();
        i.sse_customer_algorithm = Some("AES256".into());
        assert!(i.check_supported().is_ok());
        let mut c = CreateMultipartUploadInput::builder().bucket("b".into()).key("k".into()).build().unwrap();
        c.sse_customer_algorithm = Some("AES256".into());
        assert!(c.check_supported().is_ok());
        c.ssekms_key_id = Some("k".into());
        assert!(not_implemented(c.check_supported()).contains("SSE-KMS"));
        let mut i = put();
        i.server_side_encryption = Some(ServerSideEncryption::from_static(ServerSideEncryption::AES256));
        assert!(not_implemented(i.check_supported()).contains("SSE-S3"));
        let mut i = put();
        i.ssekms_key_id = Some("k".into());
        assert!(not_implemented(i.check_supported()).contains("SSE-KMS"));
    }

    #[test]
    fn private_and_standard_are_what_we_do_other_values_are_refused() {
        let mut i = put();
        i.acl = Some(ObjectCannedACL::from_static(ObjectCannedACL::PRIVATE));
        i.storage_class = Some(StorageClass::from_static(StorageClass::STANDARD));
        assert!(i.check_supported().is_ok());
        i.acl = Some(ObjectCannedACL::from_static(ObjectCannedACL::PUBLIC_READ));
        assert!(not_implemented(i.check_supported()).contains("x-amz-acl"));
        let mut i = put();
        i.storage_class = Some(StorageClass::from_static(StorageClass::GLACIER));
        assert!(not_implemented(i.check_supported()).contains("storage-class"));
    }

    #[test]
    fn an_expected_bucket_owner_is_refused_on_every_operation_that_takes_one() {
        let owner = || Some("111122223333".to_owned());
        let mut head = HeadBucketInput::builder().bucket("b".into()).build().unwrap();
        head.expected_bucket_owner = owner();
        assert!(not_implemented(head.check_supported()).contains("expected-bucket-owner"));
        let mut list = ListObjectsV2Input::builder().bucket("b".into()).build().unwrap();
        assert!(list.check_supported().is_ok());
        list.expected_bucket_owner = owner();
        assert!(not_implemented(list.check_supported()).contains("expected-bucket-owner"));
        let mut abort = AbortMultipartUploadInput::builder()
            .bucket("b".into())
            .key("k".into())
            .upload_id("u".into())
            .build()
            .unwrap();
        abort.request_payer = Some(RequestPayer::from_static(RequestPayer::REQUESTER));
        assert!(abort.check_supported().is_ok(), "request-payer has no effect here");
        abort.if_match_initiated_time = Some(s3s::dto::Timestamp::from(std::time::SystemTime::UNIX_EPOCH));
        assert!(not_implemented(abort.check_supported()).contains("initiated-time"));
    }
}
