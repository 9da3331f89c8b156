//! LightningStor: S3-compatible object store (to be built; see issue tracker).
