//! Who may read the incident API: a bearer token reviewed by the apiserver (TokenReview and
//! SubjectAccessReview for `get`/`list` on `incidents.gpumedic.io`). The gate is shared with the
//! console and lives in the runtime ([`gpumedic_runtime::api_auth`]); this module names it where
//! the classifier has always found it.

pub use gpumedic_runtime::api_auth::*;
