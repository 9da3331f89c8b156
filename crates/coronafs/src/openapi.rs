//! The OpenAPI 3 description of the control API, served at `/openapi.json`.
//! Written by hand (serde_json) to stay in step with `api.rs`; a test
//! checks that every route of the router is described.

use serde_json::{Value, json};

fn err(desc: &str) -> Value {
    json!({"description": desc, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}})
}

fn ok(desc: &str, schema: &str) -> Value {
    json!({"description": desc, "content": {"application/json": {"schema": {"$ref": format!("#/components/schemas/{schema}")}}}})
}

fn list_of(desc: &str, schema: &str) -> Value {
    json!({"description": desc, "content": {"application/json": {"schema": {"type": "array", "items": {"$ref": format!("#/components/schemas/{schema}")}}}}})
}

fn body(schema: &str) -> Value {
    json!({"required": true, "content": {"application/json": {"schema": {"$ref": format!("#/components/schemas/{schema}")}}}})
}

fn path_param(name: &str, desc: &str) -> Value {
    json!({"name": name, "in": "path", "required": true, "description": desc, "schema": {"type": "string"}})
}

fn force() -> Value {
    json!({"name": "force", "in": "query", "required": false, "schema": {"type": "boolean", "default": false},
           "description": "delete even if the target is in use or has clones"})
}

/// The whole document.
pub fn document() -> Value {
    let vol = path_param("name", "volume name");
    json!({
        "openapi": "3.0.3",
        "info": {"title": "CoronaFS control API", "version": env!("CARGO_PKG_VERSION"),
                 "description": "Thin block volumes, O(1) snapshots and copy-on-write clones, exported over NBD as VOL (read-write) and VOL@SNAP (read-only). Every error answers {\"error\": message}. With an API token set on the server, every operation but GET /healthz and GET /metrics needs Authorization: Bearer TOKEN (401 with WWW-Authenticate: Bearer otherwise)."},
        "security": [{"bearerAuth": []}],
        "paths": {
            "/healthz": {"get": {"summary": "liveness", "security": [], "responses": {"200": {"description": "ok"}}}},
            "/metrics": {"get": {"summary": "Prometheus metrics", "security": [], "responses": {"200": {"description": "text exposition format"}}}},
            "/openapi.json": {"get": {"summary": "this document", "responses": {"200": {"description": "OpenAPI 3"}}}},
            "/v1/info": {"get": {"summary": "the server's conditions: version, engine in use, data dir and its file system, O_DIRECT, host",
                                 "responses": {"200": ok("the server", "ServerInfo")}}},
            "/v1/cluster/map": {"get": {"summary": "the volume map (Raft) as this node has applied it: the leader, the term, and every replicated volume's copies, primary, epoch and in-sync copies",
                                        "responses": {"200": {"description": "the map", "content": {"application/json": {"schema": {"type": "object"}}}}, "404": err("the server is in no cluster")}}},
            "/v1/cluster/nodes": {
                "post": {"summary": "make a running node a voter of the volume map's Raft group",
                         "description": "The leader adds it as a learner, waits until it holds the map's log, then makes it a voter; a node that does not take the log in time is taken out again (nothing changes). Adding a voter again changes nothing. The other nodes place copies on it once they restart with a cluster file that lists it.",
                         "requestBody": body("AddNode"),
                         "responses": {"200": {"description": "the map, with the voters after the change", "content": {"application/json": {"schema": {"type": "object"}}}},
                                       "400": err("bad body or address"), "404": err("the server is in no cluster"),
                                       "409": err("the node's map id is another node's"), "503": err("no leader, or the node did not take the log in time (nothing was changed)")}}
            },
            "/v1/cluster/nodes/{name}": {
                "parameters": [path_param("name", "node name")],
                "delete": {"summary": "take a node out of the volume map's Raft group",
                           "description": "Refused while the node is a replicated volume's primary, holds a copy its volume cannot spare (fewer copies than the write quorum would remain), or is the last voter. Its copies stay copies until replaced (replace-copy).",
                           "responses": {"200": {"description": "the map, with the voters after the change", "content": {"application/json": {"schema": {"type": "object"}}}},
                                         "404": err("the server is in no cluster"),
                                         "409": err("not a voter, a primary, a copy its volume needs, or the last voter (the message says which)"),
                                         "503": err("no leader (nothing was changed)")}}
            },
            "/v1/volumes": {
                "get": {"summary": "list volumes, sorted by name", "responses": {"200": list_of("volumes", "VolumeInfo")}},
                "post": {"summary": "create a volume, or clone one from a snapshot (O(1))",
                         "requestBody": body("CreateVolume"),
                         "responses": {"201": ok("created", "VolumeInfo"), "400": err("invalid name, size or body"),
                                       "403": err("server is read-only"), "404": err("snapshot not found"),
                                       "409": err("exists, the snapshot's chain is too deep, fewer nodes than replicas hold the snapshot, or copies of a deleted volume of that name are still to be deleted"), "507": err("no space")}}
            },
            "/v1/volumes/{name}": {
                "parameters": [vol],
                "get": {"summary": "show a volume", "responses": {"200": ok("the volume", "VolumeInfo"), "400": err("invalid name"), "404": err("not found")}},
                "delete": {"summary": "delete a volume and its snapshots; on a replicated volume's primary, on every copy (copies that cannot be reached are deleted once they can)", "parameters": [force()],
                           "responses": {"204": {"description": "deleted"}, "404": err("not found"),
                                         "409": err("open NBD connections or clones, and force not given")}}
            },
            "/v1/volumes/{name}/resize": {
                "parameters": [vol],
                "post": {"summary": "grow (or with allow_shrink, shrink); clients see it on reconnect",
                         "requestBody": body("ResizeVolume"),
                         "responses": {"200": ok("resized", "VolumeInfo"), "400": err("shrink without allow_shrink, a shrink of a replicated volume, or bad size"), "404": err("not found"),
                                       "409": err("asked of a node holding a replica copy (ask the primary)"),
                                       "502": err("grown on the primary, but fewer than the write quorum of copies took it (they grow when they catch up)")}}
            },
            "/v1/volumes/{name}/flatten": {
                "parameters": [vol],
                "post": {"summary": "copy all inherited data in and detach from the parent (parent becomes null)",
                         "responses": {"200": ok("flattened", "VolumeInfo"), "404": err("not found"),
                                       "409": err("asked of a node holding a replica copy (ask the primary)"), "507": err("no space")}}
            },
            "/v1/volumes/{name}/fence": {
                "parameters": [vol],
                "post": {"summary": "raise the write epoch; answers once no write of an older epoch is in flight",
                         "description": "Clients declare an epoch by opening the export as VOL;epoch=N. WRITE, TRIM and WRITE_ZEROES from a connection whose epoch is below the volume's are answered EPERM; opening with a lower epoch is refused; opening without one is read-only once the epoch is above 0. The epoch is persisted before any connection is fenced.",
                         "requestBody": body("FenceVolume"),
                         "responses": {"200": ok("fenced and drained", "VolumeInfo"), "400": err("bad body"), "403": err("server is read-only"),
                                       "404": err("not found"), "409": err("the epoch is below the current one"),
                                       "503": err("the epoch is raised, but older writes did not finish within 30 s")}}
            },
            "/v1/volumes/{name}/promote": {
                "parameters": [vol],
                "post": {"summary": "make this node's copy of a replicated volume the primary (failover)",
                         "description": "The node asks the cluster's volume map for a takeover: the map grants it only to a copy in its in-sync set, once the old primary's lease has run out (the node waits up to a lease for that), at a new epoch above every epoch the copy has seen. The node then fences the other copies at that epoch and serves the volume, with the copies at its own position as live replicas and the others stale until they caught up.",
                         "responses": {"200": ok("promoted", "VolumeInfo"), "403": err("server is read-only"), "404": err("not found"),
                                       "409": err("already primary, not a replica, not in sync, or the map made another copy the primary (the message says why)"),
                                       "500": err("not in a cluster"), "503": err("the volume map could not be reached")}}
            },
            "/v1/volumes/{name}/replace-copy": {
                "parameters": [vol],
                "post": {"summary": "on a replicated volume's primary: replace one copy by a new copy on another node",
                         "description": "The new node gets an empty copy through its control API, the volume map gives it the old copy's place (out of sync), and the primary fills it in the background at resync_bytes_per_sec; it joins the in-sync set when caught up (replica_states shows it). The old copy is deleted when its node can be reached, or when that node next starts. A primary replaces a copy by itself once it has been out of sync for replace_after_ms (cluster file).",
                         "requestBody": body("ReplaceCopy"),
                         "responses": {"200": ok("replaced; the new copy is being filled", "VolumeInfo"), "400": err("bad body, or the node holds no copy or is not in the cluster file"),
                                       "403": err("server is read-only"), "404": err("not found"),
                                       "409": err("not the primary, the new node holds a copy already, no spare node, or the in-sync copies would fall below the write quorum"),
                                       "500": err("creating the new copy failed (nothing was changed)"), "503": err("the volume map could not be reached (nothing was changed)")}}
            },
            "/v1/volumes/{name}/evict": {
                "parameters": [vol],
                "post": {"summary": "drop the volume's files from the server's page cache",
                         "description": "Every file of the volume's layer chain (its own layer and each parent's: data files, then maps) is synced (fdatasync: dirty pages cannot be dropped) and then dropped with posix_fadvise(POSIX_FADV_DONTNEED), so the next reads come from the disk. Residency is measured before and after with cachestat(2), or mincore(2) where cachestat is missing. NBD traffic goes on meanwhile and may read pages back in.",
                         "responses": {"200": ok("evicted", "EvictReport"), "400": err("invalid name"), "404": err("not found")}}
            },
            "/v1/volumes/{name}/snapshots": {
                "parameters": [vol],
                "get": {"summary": "list a volume's snapshots", "responses": {"200": list_of("snapshots", "SnapshotInfo"), "404": err("volume not found")}},
                "post": {"summary": "take a read-only snapshot (O(1)), exported as VOL@SNAP", "requestBody": body("CreateSnapshot"),
                         "responses": {"201": ok("taken", "SnapshotInfo"), "400": err("invalid name"), "404": err("volume not found"),
                                       "409": err("exists, or the chain is too deep")}}
            },
            "/v1/volumes/{name}/snapshots/{snap}": {
                "parameters": [vol, path_param("snap", "snapshot name")],
                "delete": {"summary": "delete a snapshot", "parameters": [force()],
                           "responses": {"204": {"description": "deleted"}, "404": err("not found"), "409": err("has clones or NBD clients, and force not given")}}
            }
        },
        "components": {
        "securitySchemes": {"bearerAuth": {"type": "http", "scheme": "bearer",
            "description": "the server's API token (coronafs serve --api-token-file, CORONAFS_API_TOKEN or api_token_file)"}},
        "schemas": {
            "Error": {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}},
            "ServerInfo": {"type": "object", "required": ["version", "engine", "data_dir", "fs", "o_direct", "note", "host"], "properties": {
                "version": {"type": "string"},
                "engine": {"type": "string", "enum": ["uring", "threads"], "description": "the engine in use, after any fallback from uring"},
                "data_dir": {"type": "string"},
                "fs": {"$ref": "#/components/schemas/FsInfo"},
                "o_direct": {"type": "boolean", "description": "whether volume files are opened with O_DIRECT (false: buffered I/O through the page cache)"},
                "note": {"type": "string", "description": "how volume data reaches the disk, in words"},
                "host": {"$ref": "#/components/schemas/Host"}}},
            "FsInfo": {"type": "object", "required": ["path", "mount_point", "fs_type", "device"], "properties": {
                "path": {"type": "string", "description": "the directory asked about"},
                "mount_point": {"type": "string"},
                "fs_type": {"type": "string", "description": "ext4, xfs, tmpfs, overlay, ...; \"unknown\" if not found"},
                "device": {"type": "string", "description": "what is mounted: a device such as /dev/vda, or a pseudo source"}}},
            "Host": {"type": "object", "required": ["hostname", "kernel", "cpu_model", "cpus", "memory_bytes"], "properties": {
                "hostname": {"type": "string"},
                "kernel": {"type": "string", "description": "uname -srm"},
                "cpu_model": {"type": "string"},
                "cpus": {"type": "integer", "description": "CPUs this process may run on"},
                "memory_bytes": {"type": "integer", "format": "int64"}}},
            "EvictReport": {"type": "object", "required": ["volume", "files", "bytes", "resident_before", "resident_after"], "properties": {
                "volume": {"type": "string"},
                "files": {"type": "array", "items": {"type": "string"}, "description": "paths of the layer chain's files, head first"},
                "bytes": {"type": "integer", "format": "int64", "description": "their total length (sparse files at full length)"},
                "resident_before": {"type": "integer", "format": "int64", "description": "bytes of them in the page cache before"},
                "resident_after": {"type": "integer", "format": "int64", "description": "bytes still there after"}}},
            "CreateVolume": {"type": "object", "required": ["name"], "additionalProperties": false, "properties": {
                "name": {"type": "string", "pattern": "^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$"},
                "size": {"type": "integer", "format": "int64", "minimum": 1, "description": "bytes; required unless from_snapshot"},
                "from_snapshot": {"type": "string", "description": "VOL@SNAP to clone; size defaults to the snapshot's and may only be larger"},
                "replicas": {"type": "integer", "minimum": 1, "default": 1, "description": "copies on as many nodes of the server's cluster, different zones first; this server is the primary; with from_snapshot, an O(1) clone on each node holding the snapshot (409 if fewer do)"}}},
            "ResizeVolume": {"type": "object", "required": ["size"], "additionalProperties": false, "properties": {
                "size": {"type": "integer", "format": "int64", "minimum": 1},
                "allow_shrink": {"type": "boolean", "default": false}}},
            "FenceVolume": {"type": "object", "required": ["epoch"], "additionalProperties": false, "properties": {
                "epoch": {"type": "integer", "format": "int64", "minimum": 0, "description": "new epoch, at least the current one"}}},
            "AddNode": {"type": "object", "required": ["name", "replica"], "additionalProperties": false, "properties": {
                "name": {"type": "string", "description": "the node's name in the cluster file"},
                "replica": {"type": "string", "description": "its replica address, host:port (where the map's RPC reaches it)"}}},
            "ReplaceCopy": {"type": "object", "required": ["copy"], "additionalProperties": false, "properties": {
                "copy": {"type": "string", "description": "the node whose copy is replaced"},
                "to": {"type": "string", "description": "the node of the new copy; default: one holding no copy, in a zone the other copies do not use if there is one"}}},
            "CreateSnapshot": {"type": "object", "required": ["name"], "additionalProperties": false, "properties": {
                "name": {"type": "string"}}},
            "VolumeInfo": {"type": "object", "required": ["name", "size", "allocated_bytes", "parent", "snapshots", "connections", "read_only", "nbd_export"], "properties": {
                "name": {"type": "string"},
                "size": {"type": "integer", "format": "int64"},
                "allocated_bytes": {"type": "integer", "format": "int64", "description": "space held by this volume's own layer"},
                "parent": {"type": "string", "nullable": true, "description": "VOL@SNAP it was cloned from, null once flattened"},
                "snapshots": {"type": "array", "items": {"type": "string"}},
                "connections": {"type": "integer"},
                "read_only": {"type": "boolean"},
                "nbd_export": {"type": "string"},
                "epoch": {"type": "integer", "format": "int64", "description": "write epoch; exports opened as VOL;epoch=N with a lower N cannot write"},
                "replicas": {"type": "array", "items": {"type": "string"}, "description": "nodes holding the other copies of a replicated volume; absent for a volume on this node only"},
                "stale_replicas": {"type": "array", "items": {"type": "string"}, "description": "those of replicas out of the live set (dropped after a failure, or not in sync when the primary opened the volume) until a resync brought them back"},
                "replica_states": {"type": "array", "description": "GET /v1/volumes/{name} on the primary: each replica's state (from the running volume while it is open, else from the volume map)", "items": {"$ref": "#/components/schemas/ReplicaStatus"}}}},
            "ReplicaStatus": {"type": "object", "required": ["node", "state"], "properties": {
                "node": {"type": "string"},
                "state": {"type": "string", "enum": ["in_sync", "catching_up", "stale"], "description": "in_sync: in the live set; catching_up: the primary is copying the regions it lacks; stale: out of the live set, not being copied to now"},
                "bytes_left": {"type": "integer", "format": "int64", "description": "catching_up only: bytes the running resync pass has still to copy"},
                "out_since_ms": {"type": "integer", "format": "int64", "description": "out of the volume map's in-sync set since then (Unix milliseconds): away, failing, or being filled"}}},
            "SnapshotInfo": {"type": "object", "required": ["volume", "name", "size", "allocated_bytes", "clones", "nbd_export"], "properties": {
                "volume": {"type": "string"},
                "name": {"type": "string"},
                "size": {"type": "integer", "format": "int64"},
                "allocated_bytes": {"type": "integer", "format": "int64"},
                "clones": {"type": "array", "items": {"type": "string"}},
                "nbd_export": {"type": "string", "description": "VOL@SNAP, read-only"},
                "missing_on": {"type": "array", "items": {"type": "string"}, "description": "of a replicated volume, on its primary (absent when empty): the copies that lack this snapshot because they were out of the live set or failed it when it was taken; a resync does not bring it to them"}}}
        }}
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_route_of_the_api_is_described() {
        let doc = super::document();
        let src = include_str!("api.rs");
        for line in src.lines().filter(|l| l.trim_start().starts_with(".route(\"")) {
            let path = line.split('"').nth(1).expect("route path");
            assert!(doc["paths"].get(path).is_some(), "{path} is not in /openapi.json");
        }
        assert_eq!(doc["paths"].as_object().map(|p| p.len()), Some(17));
    }

    #[test]
    fn the_bearer_scheme_covers_all_but_health_and_metrics() {
        let doc = super::document();
        assert_eq!(doc["components"]["securitySchemes"]["bearerAuth"]["scheme"], "bearer");
        assert_eq!(doc["security"][0]["bearerAuth"], serde_json::json!([]));
        for open in svc_kit::api_token::OPEN_PATHS {
            assert_eq!(doc["paths"][open]["get"]["security"], serde_json::json!([]), "{open}");
        }
        assert!(doc["paths"]["/v1/volumes"]["post"].get("security").is_none(), "the global scheme applies");
    }
}
