//! The OpenAPI 3.1 description served at `/openapi.json`. Written by hand,
//! kept honest by the integration test that checks every route of
//! [`crate::api::ROUTES`] appears here and every response validates against
//! the schema documented for it.

use serde_json::{Value, json};

fn nullable(t: &str) -> Value {
    json!({ "type": [t, "null"] })
}

fn schemas() -> Value {
    let status = json!({ "type": "string", "enum": ["queued", "uploading", "importing", "active", "creating", "downloading", "available", "error"] });
    json!({
        "Status": status,
        "ApiError": { "type": "object", "required": ["error"], "properties": { "error": { "type": "string" } } },
        "Image": {
            "type": "object",
            "required": ["id", "name", "status", "disk_format", "declared_format", "virtual_size", "size", "sha256", "expected_sha256", "bytes_done", "bytes_total", "error_reason", "created_at"],
            "properties": {
                "id": { "type": "string" },
                "name": { "type": "string" },
                "status": { "$ref": "#/components/schemas/Status" },
                "disk_format": { "type": ["string", "null"], "enum": ["raw", "qcow2", null] },
                "declared_format": { "type": ["string", "null"], "enum": ["raw", "qcow2", null] },
                "virtual_size": nullable("integer"),
                "size": nullable("integer"),
                "sha256": nullable("string"),
                "expected_sha256": nullable("string"),
                "bytes_done": { "type": "integer" },
                "bytes_total": nullable("integer"),
                "error_reason": nullable("string"),
                "created_at": { "type": "integer" }
            }
        },
        "Volume": {
            "type": "object",
            "required": ["id", "image_id", "status", "size", "coronafs_volume", "nbd_uri", "bytes_done", "bytes_total", "cache_hit", "error_reason", "created_at", "elapsed_ms"],
            "properties": {
                "id": { "type": "string" },
                "image_id": { "type": "string" },
                "status": { "$ref": "#/components/schemas/Status" },
                "size": { "type": "integer" },
                "coronafs_volume": { "type": "string" },
                "nbd_uri": nullable("string"),
                "bytes_done": { "type": "integer" },
                "bytes_total": { "type": "integer" },
                "cache_hit": { "type": "boolean" },
                "error_reason": nullable("string"),
                "created_at": { "type": "integer" },
                "elapsed_ms": nullable("integer")
            }
        },
        "Vm": {
            "type": "object",
            "required": ["id", "volume_id", "worker", "epoch", "status", "migrations", "writes_acked", "verified_blocks", "error_reason"],
            "properties": {
                "id": { "type": "string" },
                "volume_id": { "type": "string" },
                "worker": { "type": "string" },
                "epoch": { "type": "integer" },
                "status": { "type": "string", "enum": ["running", "migrating", "error"] },
                "migrations": { "type": "integer" },
                "writes_acked": { "type": "integer" },
                "writes_acked_earlier": { "type": "integer" },
                "verified_blocks": { "type": "integer" },
                "error_reason": nullable("string"),
                "notice": nullable("string")
            }
        },
        "CacheEntry": {
            "type": "object",
            "required": ["image_id", "base_volume", "snapshot", "virtual_size", "last_used_ms"],
            "properties": {
                "image_id": { "type": "string" },
                "base_volume": { "type": "string" },
                "snapshot": { "type": "string" },
                "virtual_size": { "type": "integer" },
                "last_used_ms": { "type": "integer" }
            }
        },
        "CacheStats": {
            "type": "object",
            "required": ["hits", "misses", "evictions", "bases"],
            "properties": {
                "hits": { "type": "integer" },
                "misses": { "type": "integer" },
                "evictions": { "type": "integer" },
                "bases": { "type": "array", "items": { "$ref": "#/components/schemas/CacheEntry" } }
            }
        },
        "S3Source": {
            "type": "object", "additionalProperties": false, "required": ["bucket", "key"],
            "properties": { "bucket": { "type": "string" }, "key": { "type": "string" } }
        },
        "CreateImage": {
            "type": "object", "additionalProperties": false, "required": ["name"],
            "properties": {
                "name": { "type": "string" },
                "sha256": { "type": "string", "pattern": "^[0-9a-fA-F]{64}$" },
                "disk_format": { "type": "string", "enum": ["raw", "qcow2", "auto"] },
                "import_url": { "type": "string" },
                "import_s3": { "$ref": "#/components/schemas/S3Source" }
            }
        },
        "CreateVolume": {
            "type": "object", "additionalProperties": false, "required": ["image_id"],
            "properties": { "image_id": { "type": "string" }, "size": { "type": "integer" } }
        },
        "CreateVm": {
            "type": "object", "additionalProperties": false, "required": ["volume_id", "worker"],
            "properties": { "volume_id": { "type": "string" }, "worker": { "type": "string" }, "io_ops": { "type": "integer" } }
        },
        "MigrateVm": {
            "type": "object", "additionalProperties": false, "required": ["worker"],
            "properties": { "worker": { "type": "string" } }
        }
    })
}

fn r(schema: &str) -> Value {
    json!({ "$ref": format!("#/components/schemas/{schema}") })
}

fn ok(code: &str, desc: &str, schema: Option<Value>) -> (String, Value) {
    let mut v = json!({ "description": desc });
    if let Some(s) = schema {
        v["content"] = json!({ "application/json": { "schema": s } });
    }
    (code.to_owned(), v)
}

fn op(summary: &str, body: Option<&str>, responses: Vec<(String, Value)>) -> Value {
    let mut resp = serde_json::Map::new();
    for (c, v) in responses {
        resp.insert(c, v);
    }
    resp.insert(
        "default".into(),
        json!({ "description": "error", "content": { "application/json": { "schema": r("ApiError") } } }),
    );
    let mut v = json!({ "summary": summary, "responses": resp });
    if let Some(b) = body {
        v["requestBody"] = json!({ "required": true, "content": { "application/json": { "schema": r(b) } } });
    }
    v
}

fn id_param() -> Value {
    json!([{ "name": "id", "in": "path", "required": true, "schema": { "type": "string" } }])
}

/// `v` with no security requirement (monitoring reads need no token).
fn open(mut v: Value) -> Value {
    v["security"] = json!([]);
    v
}

/// The whole document.
pub fn document() -> Value {
    let arr = |s: &str| json!({ "type": "array", "items": r(s) });
    let text = |d: &str| ok("200", d, None);
    let mut upload = op(
        "Upload the artifact (streamed; answered when stored)",
        None,
        vec![ok("200", "image stored", Some(r("Image")))],
    );
    upload["requestBody"] = json!({ "required": true, "content": { "application/octet-stream": { "schema": { "type": "string", "format": "binary" } } } });
    upload["parameters"] = id_param();
    let with_id = |mut v: Value| {
        v["parameters"] = id_param();
        v
    };
    json!({
        "openapi": "3.1.0",
        "info": { "title": "PlasmaVMC", "version": env!("CARGO_PKG_VERSION"), "description": "VM images in LightningStor, volumes in CoronaFS, emulated VM attach and migration. With an API token set on the server, every operation but GET /healthz and GET /metrics needs Authorization: Bearer TOKEN (401 with WWW-Authenticate: Bearer otherwise)." },
        "security": [{ "bearerAuth": [] }],
        "paths": {
            "/healthz": { "get": open(op("Liveness", None, vec![text("ok")])) },
            "/metrics": { "get": open(op("Prometheus metrics", None, vec![text("metrics text")])) },
            "/openapi.json": { "get": op("This document", None, vec![ok("200", "OpenAPI", Some(json!({ "type": "object" })))]) },
            "/v1/images": {
                "get": op("List images", None, vec![ok("200", "images", Some(arr("Image")))]),
                "post": op("Create an image record (and start an import if asked)", Some("CreateImage"), vec![ok("201", "queued for upload", Some(r("Image"))), ok("202", "import started", Some(r("Image")))])
            },
            "/v1/images/{id}": {
                "get": with_id(op("Show an image", None, vec![ok("200", "image", Some(r("Image")))])),
                "delete": with_id(op("Delete an image (refused while volumes use it)", None, vec![ok("204", "deleted", None)]))
            },
            "/v1/images/{id}/file": { "put": upload },
            "/v1/volumes": {
                "get": op("List volumes", None, vec![ok("200", "volumes", Some(arr("Volume")))]),
                "post": op("Create a volume from an image", Some("CreateVolume"), vec![ok("202", "accepted; poll until available", Some(r("Volume")))])
            },
            "/v1/volumes/{id}": {
                "get": with_id(op("Show a volume", None, vec![ok("200", "volume", Some(r("Volume")))])),
                "delete": with_id(op("Delete a volume", None, vec![ok("204", "deleted", None)]))
            },
            "/v1/vms": {
                "get": op("List VMs", None, vec![ok("200", "VMs", Some(arr("Vm")))]),
                "post": op("Attach a volume on a worker", Some("CreateVm"), vec![ok("201", "attached", Some(r("Vm")))])
            },
            "/v1/vms/{id}": {
                "get": with_id(op("Show a VM", None, vec![ok("200", "VM", Some(r("Vm")))])),
                "delete": with_id(op("Detach and forget a VM", None, vec![ok("204", "deleted", None)]))
            },
            "/v1/vms/{id}/migrate": { "post": with_id(op("Move a VM to another worker", Some("MigrateVm"), vec![ok("200", "migrated", Some(r("Vm")))])) },
            "/v1/cache": { "get": op("Cache counters and bases", None, vec![ok("200", "cache", Some(r("CacheStats")))]) }
        },
        "components": {
            "securitySchemes": { "bearerAuth": { "type": "http", "scheme": "bearer",
                "description": "the server's API token (plasmavmc serve --api-token-file, PLASMAVMC_API_TOKEN or api_token_file)" } },
            "schemas": schemas()
        }
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_bearer_scheme_covers_all_but_health_and_metrics() {
        let doc = super::document();
        assert_eq!(doc["components"]["securitySchemes"]["bearerAuth"]["scheme"], "bearer");
        assert_eq!(doc["security"][0]["bearerAuth"], serde_json::json!([]));
        let mut ops = 0;
        for (path, item) in doc["paths"].as_object().expect("paths") {
            for (method, op) in item.as_object().expect("item") {
                let open = svc_kit::api_token::OPEN_PATHS.contains(&path.as_str());
                assert_eq!(op.get("security") == Some(&serde_json::json!([])), open, "{method} {path}");
                ops += 1;
            }
        }
        assert!(ops > 10, "{ops} operations");
    }
}
