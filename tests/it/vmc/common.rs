//! The whole stack in one process for the PlasmaVMC tests: a LightningStor
//! node (real HTTP), a CoronaFS server (real NBD + API) and a PlasmaVMC
//! server on one runtime, plus qemu-img helpers and a small JSON-schema check
//! for the OpenAPI test. The API is driven through its typed client
//! ([`plasmavmc::client::Client`]); raw requests only send what that client
//! cannot (malformed bodies, unknown fields) or read raw JSON for the schema
//! check.

use coronafs::backend::IoEngine;
use coronafs::client::NbdClient;
use plasmavmc::client::Client;
use plasmavmc::model::{CreateImage, CreateVolume, Image, Status, Volume};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;
use svc_kit::api_token::ApiToken;

pub const AK: &str = "vmc-test-key";
pub const SK: &str = "vmc-test-secret-0123456789";

pub struct Stack {
    pub rt: tokio::runtime::Runtime,
    pub dir: tempfile::TempDir,
    pub ls: Option<lightningstor::server::Running>,
    pub corona: Option<coronafs::service::RunningServer>,
    pub vmc: Option<plasmavmc::Server>,
    /// The REST API's token (the stack runs with tokens, as deployed:
    /// CoronaFS's API has one too, which PlasmaVMC is configured with).
    pub token: ApiToken,
    pub http: reqwest::Client,
    pub url: String,
    /// The typed client of the API.
    pub api: Client,
    pub s3: aws_sdk_s3::Client,
}

impl Stack {
    pub fn start() -> Self {
        Self::start_with(|_| {})
    }

    pub fn start_with(f: impl FnOnce(&mut plasmavmc::Config)) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(4).enable_all().build().expect("runtime");
        let mut lcfg = lightningstor::Config::new(dir.path().join("ls")).with_keys(AK, SK);
        lcfg.listen = "127.0.0.1:0".parse().expect("addr");
        lcfg.fsync = false;
        let (ls, _) = rt.block_on(lightningstor::server::start(lcfg)).expect("lightningstor");
        let mut ccfg = coronafs::config::ServerConfig::ephemeral(dir.path().join("corona"), IoEngine::Threads);
        let corona_token = ApiToken::random().expect("token");
        ccfg.api_token = Some(corona_token.clone());
        let token = ApiToken::random().expect("token");
        let corona = rt.block_on(coronafs::service::start(ccfg)).expect("coronafs");
        let mut cfg = plasmavmc::Config {
            listen: "127.0.0.1:0".parse().expect("addr"),
            data_dir: dir.path().join("vmc"),
            s3_endpoint: format!("http://{}", ls.addr),
            s3_access_key: AK.into(),
            s3_secret_key: SK.into(),
            coronafs_api: corona.api_url(),
            coronafs_nbd: corona.nbd_addr.to_string(),
            part_size: 5 << 20,
            fetch_chunk: 1 << 20,
            coronafs_api_token: Some(corona_token.expose().to_owned()),
            api_token: Some(token.expose().to_owned()),
            ..plasmavmc::Config::default()
        };
        f(&mut cfg);
        let vmc = rt.block_on(plasmavmc::Server::start(cfg)).expect("plasmavmc");
        let url = vmc.url();
        let conf = aws_sdk_s3::config::Builder::new()
            .behavior_version(aws_sdk_s3::config::BehaviorVersion::latest())
            .region(aws_sdk_s3::config::Region::new("us-east-1"))
            .credentials_provider(aws_credential_types::Credentials::new(AK, SK, None, None, "test"))
            .endpoint_url(format!("http://{}", ls.addr))
            .force_path_style(true)
            .build();
        Stack {
            rt,
            dir,
            ls: Some(ls),
            corona: Some(corona),
            vmc: Some(vmc),
            http: reqwest::Client::new(),
            api: Client::new(&url).with_token(Some(token.clone())),
            token,
            url,
            s3: aws_sdk_s3::Client::from_conf(conf),
        }
    }

    pub fn app(&self) -> &std::sync::Arc<plasmavmc::app::App> {
        &self.vmc.as_ref().expect("running").app
    }

    pub fn nbd_addr(&self) -> std::net::SocketAddr {
        self.corona.as_ref().expect("running").nbd_addr
    }

    pub fn work(&self) -> PathBuf {
        let p = self.dir.path().join("work");
        std::fs::create_dir_all(&p).expect("mkdir");
        p
    }

    /// Runs `f` on the stack's runtime.
    pub fn run<F: std::future::Future>(&self, f: F) -> F::Output {
        self.rt.block_on(f)
    }

    /// A raw request and its status and JSON body (Null when empty): for
    /// what the typed client cannot send, and for raw JSON.
    pub fn call(&self, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
        let url = format!("{}{path}", self.url);
        self.rt.block_on(async {
            let m = reqwest::Method::from_bytes(method.as_bytes()).expect("method");
            let mut req = self.http.request(m, url).bearer_auth(self.token.expose());
            if let Some(b) = body {
                req = req.json(&b);
            }
            let resp = req.send().await.expect("send");
            let status = resp.status().as_u16();
            let text = resp.text().await.expect("body");
            let v =
                if text.is_empty() { Value::Null } else { serde_json::from_str(&text).unwrap_or(Value::String(text)) };
            (status, v)
        })
    }

    /// A raw request with any body.
    pub fn raw_call(&self, method: &str, path: &str, body: Vec<u8>, ctype: &str) -> (u16, Value) {
        let url = format!("{}{path}", self.url);
        self.rt.block_on(async {
            let m = reqwest::Method::from_bytes(method.as_bytes()).expect("method");
            let req = self.http.request(m, url).bearer_auth(self.token.expose()).header("content-type", ctype);
            let resp = req.body(body).send().await.expect("send");
            let status = resp.status().as_u16();
            let text = resp.text().await.expect("body");
            (status, serde_json::from_str(&text).unwrap_or(Value::String(text)))
        })
    }

    /// Creates the image `req` asks for and uploads `path` into it; the
    /// upload's answer.
    pub fn upload(&self, req: CreateImage, path: &Path) -> plasmavmc::Result<Image> {
        self.run(async {
            let img = self.api.create_image(&req).await.expect("create image");
            assert_eq!(img.status, Status::Queued, "{img:?}");
            self.api.upload_file(&img.id, path, None).await
        })
    }

    pub fn upload_ok(&self, name: &str, path: &Path) -> Image {
        let img = self.upload(CreateImage { name: name.into(), ..Default::default() }, path).expect("upload");
        assert_eq!(img.status, Status::Active, "{img:?}");
        img
    }

    /// Polls a volume until it leaves creating/downloading.
    pub fn wait_volume(&self, id: &str) -> Volume {
        self.run(self.api.wait_volume(id, Duration::from_millis(20), Duration::from_secs(180))).expect("wait volume")
    }

    pub fn create_volume(&self, image_id: &str, size: Option<u64>) -> Volume {
        let v = self.run(self.api.create_volume(&CreateVolume { image_id: image_id.into(), size })).expect("create");
        assert_eq!(v.status, Status::Creating, "{v:?}");
        self.wait_volume(&v.id)
    }

    /// The whole content of a CoronaFS export, read with our NBD client.
    pub fn read_export(&self, export: &str) -> Vec<u8> {
        let addr = self.nbd_addr();
        self.rt.block_on(async {
            let c = NbdClient::connect(addr, export).await.expect("connect");
            let size = c.size();
            let mut out = Vec::with_capacity(size as usize);
            let mut off = 0u64;
            while off < size {
                let n = (size - off).min(4 << 20) as usize;
                out.extend_from_slice(&c.read(off, n).await.expect("read"));
                off += n as u64;
            }
            c.disconnect().await.ok();
            out
        })
    }

    pub fn metric(&self, name: &str) -> u64 {
        let text = self.run(self.api.metrics()).expect("metrics");
        text.lines()
            .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(' ')).and_then(|v| v.parse().ok()))
            .unwrap_or_else(|| panic!("metric {name} missing"))
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        let (vmc, corona, ls) = (self.vmc.take(), self.corona.take(), self.ls.take());
        self.rt.block_on(async {
            if let Some(v) = vmc {
                v.shutdown().await;
            }
            if let Some(c) = corona {
                c.shutdown().await;
            }
            if let Some(l) = ls {
                l.shutdown().await;
            }
        });
    }
}

pub fn qemu_img(args: &[&str]) -> String {
    stack_tests::require("qemu-img");
    let out = stack_tests::run(Command::new("qemu-img").args(args));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

pub fn qemu_io(args: &[&str]) {
    stack_tests::require("qemu-io");
    stack_tests::run(Command::new("qemu-io").args(args));
}

/// What `qemu-img convert -O raw` makes of an artifact.
pub fn qemu_convert(src: &Path, fmt: &str) -> Vec<u8> {
    let out = src.with_extension("converted.raw");
    qemu_img(&["convert", "-f", fmt, "-O", "raw", &src.display().to_string(), &out.display().to_string()]);
    std::fs::read(&out).expect("read converted")
}

/// `qemu-img info`'s virtual size.
pub fn virtual_size(path: &Path) -> u64 {
    let info: Value =
        serde_json::from_str(&qemu_img(&["info", "--output=json", &path.display().to_string()])).expect("json");
    info["virtual-size"].as_u64().expect("virtual-size")
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    hex::encode(sha2::Sha256::digest(bytes))
}

/// A 24 MiB raw disk: patterned data in a few places (one unaligned), zeros
/// and holes elsewhere.
pub fn make_raw(dir: &Path, name: &str, seed: u64) -> PathBuf {
    let p = dir.join(name);
    let mut disk = vec![0u8; 24 << 20];
    for (off, len) in
        [(0usize, 1 << 20), (3 << 20, 512 << 10), ((10 << 20) + 123, 300_000), ((24 << 20) - 65536, 65536)]
    {
        disk[off..off + len].copy_from_slice(&stack_tests::pattern(len, seed ^ off as u64));
    }
    std::fs::write(&p, &disk).expect("write raw");
    p
}

/// The qcow2 variants the issue asks for, all made by qemu-img/qemu-io from
/// one raw disk: (label, path).
pub fn make_qcow2_family(dir: &Path, raw: &Path) -> Vec<(&'static str, PathBuf)> {
    let s = |p: &Path| p.display().to_string();
    let plain = dir.join("plain.qcow2");
    qemu_img(&["convert", "-f", "raw", "-O", "qcow2", &s(raw), &s(&plain)]);
    let compressed = dir.join("compressed.qcow2");
    qemu_img(&["convert", "-c", "-f", "raw", "-O", "qcow2", &s(raw), &s(&compressed)]);
    let v2 = dir.join("v2.qcow2");
    qemu_img(&["convert", "-f", "raw", "-O", "qcow2", "-o", "compat=0.10,cluster_size=4096", &s(raw), &s(&v2)]);
    // Zero clusters over allocated data, a zeroed-and-unmapped range, and a
    // tail that was never allocated (the image grows past the data).
    let zeros = dir.join("zeros.qcow2");
    qemu_img(&["convert", "-f", "raw", "-O", "qcow2", &s(raw), &s(&zeros)]);
    qemu_io(&[
        "-f",
        "qcow2",
        "-c",
        "write -z 0 256k",
        "-c",
        "write -z -u 3M 512k",
        "-c",
        "write -P 0xab 5M 64k",
        &s(&zeros),
    ]);
    qemu_img(&["resize", "-f", "qcow2", &s(&zeros), "40M"]);
    vec![
        ("qcow2", plain),
        ("qcow2-compressed", compressed),
        ("qcow2-v2-4k-clusters", v2),
        ("qcow2-zero-clusters", zeros),
    ]
}

/// Checks `value` against `schema` (a subset of JSON Schema: $ref, type,
/// enum, required, properties, items, additionalProperties). Every field of
/// an object must be documented.
pub fn validate(doc: &Value, schema: &Value, value: &Value, at: &str) -> Result<(), String> {
    if let Some(r) = schema.get("$ref").and_then(Value::as_str) {
        let name = r.rsplit('/').next().unwrap_or_default();
        let target = &doc["components"]["schemas"][name];
        if target.is_null() {
            return Err(format!("{at}: dangling $ref {r}"));
        }
        return validate(doc, target, value, at);
    }
    if let Some(t) = schema.get("type") {
        let types: Vec<&str> = match t {
            Value::String(s) => vec![s.as_str()],
            Value::Array(a) => a.iter().filter_map(Value::as_str).collect(),
            _ => vec![],
        };
        let actual = match value {
            Value::Null => "null",
            Value::Bool(_) => "boolean",
            Value::Number(n) if n.is_u64() || n.is_i64() => "integer",
            Value::Number(_) => "number",
            Value::String(_) => "string",
            Value::Array(_) => "array",
            Value::Object(_) => "object",
        };
        if !types.iter().any(|t| *t == actual || (*t == "number" && actual == "integer")) {
            return Err(format!("{at}: {actual} where the schema says {types:?}"));
        }
    }
    if let Some(e) = schema.get("enum").and_then(Value::as_array)
        && !e.contains(value)
    {
        return Err(format!("{at}: {value} is not one of {e:?}"));
    }
    if let Value::Object(m) = value {
        let props = schema.get("properties").and_then(Value::as_object);
        for req in schema.get("required").and_then(Value::as_array).into_iter().flatten() {
            let k = req.as_str().unwrap_or_default();
            if !m.contains_key(k) {
                return Err(format!("{at}: required field {k} missing"));
            }
        }
        if let Some(props) = props {
            for (k, v) in m {
                let Some(s) = props.get(k) else {
                    return Err(format!("{at}: field {k} is not documented"));
                };
                validate(doc, s, v, &format!("{at}.{k}"))?;
            }
        }
    }
    if let (Value::Array(a), Some(items)) = (value, schema.get("items")) {
        for (i, v) in a.iter().enumerate() {
            validate(doc, items, v, &format!("{at}[{i}]"))?;
        }
    }
    Ok(())
}

/// HTTP from a test thread: the PlasmaVMC API's typed client, and raw JSON
/// for the agents' API.
pub struct Http {
    pub rt: tokio::runtime::Runtime,
    pub c: reqwest::Client,
    /// Sent as `Authorization: Bearer` by [`Http::call`], when set.
    pub bearer: Option<String>,
}

impl Http {
    pub fn new() -> Self {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("rt");
        Http { rt, c: reqwest::Client::new(), bearer: None }
    }

    /// The same, [`Http::call`] sending `token` as a bearer token.
    pub fn with_bearer(mut self, token: &str) -> Self {
        self.bearer = Some(token.to_owned());
        self
    }

    pub fn call(&self, method: &str, url: &str, body: Option<Value>) -> (u16, Value) {
        self.rt.block_on(async {
            let mut req = self.c.request(reqwest::Method::from_bytes(method.as_bytes()).expect("method"), url);
            if let Some(t) = &self.bearer {
                req = req.bearer_auth(t);
            }
            if let Some(b) = body {
                req = req.json(&b);
            }
            let resp = req.send().await.expect("send");
            let status = resp.status().as_u16();
            let text = resp.text().await.expect("body");
            (status, serde_json::from_str(&text).unwrap_or(Value::String(text)))
        })
    }

    /// Through the PlasmaVMC API `api`: an image `name` holding `bytes`
    /// (active), then a volume from it, polled until it is available.
    pub fn image_volume(&self, api: &Client, name: &str, bytes: Vec<u8>) -> Volume {
        self.rt.block_on(async {
            let img = api.create_image(&CreateImage { name: name.into(), ..Default::default() }).await.expect("image");
            let len = bytes.len() as u64;
            let img = api.upload(&img.id, bytes.into(), len, None).await.expect("upload");
            assert_eq!(img.status, Status::Active, "{img:?}");
            let v = api.create_volume(&CreateVolume { image_id: img.id, size: None }).await.expect("volume");
            let v = api.wait_volume(&v.id, Duration::from_millis(50), Duration::from_secs(120)).await.expect("wait");
            assert_eq!(v.status, Status::Available, "{v:?}");
            v
        })
    }
}
