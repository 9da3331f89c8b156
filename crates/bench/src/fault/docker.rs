//! [`DockerDriver`]: faults on a Compose lab's containers through the Docker
//! Engine API on its unix socket (no docker CLI in the lab's image).
//!
//! Containers are found by their Compose labels (`com.docker.compose.project`
//! and `com.docker.compose.service`), so container names, which differ between
//! Compose versions, do not matter. The lab's services are named after the
//! node: `node02` holds the node's network namespace and address,
//! `node02-lightningstor` runs in that namespace ([`Fault::compose_service`]).
//! Every engine call is one HTTP/1.1 request on a fresh connection and gives
//! up after [`CALL_TIMEOUT`]; unversioned paths, so any engine version works.

use super::{Fault, FaultDriver, FaultKind};
use anyhow::{Context, anyhow, bail};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::header::{CONTENT_TYPE, HOST};
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use std::collections::{BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;
use tokio::net::UnixStream;

/// How long one engine call (connect, request, whole answer) may take.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// The environment variable naming the Compose project (set in the lab's
/// client container from `LAB_PROJECT`).
pub const PROJECT_ENV: &str = "BENCH_COMPOSE_PROJECT";

/// The project when [`PROJECT_ENV`] is not set.
pub const DEFAULT_PROJECT: &str = "lab";

const PROJECT_LABEL: &str = "com.docker.compose.project";
const SERVICE_LABEL: &str = "com.docker.compose.service";
const ONEOFF_LABEL: &str = "com.docker.compose.oneoff";

/// Applies faults to the containers of one Compose project.
#[derive(Debug)]
pub struct DockerDriver {
    /// The engine's unix socket (`/var/run/docker.sock`).
    pub socket: PathBuf,
    /// The Compose project whose containers the faults act on.
    pub project: String,
    /// Networks a partition took each container off (by container id), so
    /// that healing reconnects it with the same address and aliases.
    detached: Mutex<HashMap<String, Vec<Endpoint>>>,
}

/// A container's attachment to one network, as it was before a partition.
#[derive(Debug, Clone)]
struct Endpoint {
    network_id: String,
    network_name: String,
    ipv4: Option<String>,
    aliases: Vec<String>,
}

/// The parts of `GET /containers/{id}/json` the driver looks at.
#[derive(Debug)]
struct State {
    running: bool,
    paused: bool,
    /// `Some(id)` when the container lives in another's network namespace.
    netns_of: Option<String>,
    endpoints: Vec<Endpoint>,
}

impl State {
    fn from_inspect(id: &str, v: &Value) -> State {
        let mode = v["HostConfig"]["NetworkMode"].as_str().unwrap_or_default();
        let endpoints = v["NetworkSettings"]["Networks"]
            .as_object()
            .map(|nets| {
                nets.iter()
                    .map(|(name, ep)| Endpoint {
                        network_id: ep["NetworkID"].as_str().filter(|s| !s.is_empty()).unwrap_or(name).to_owned(),
                        network_name: name.clone(),
                        ipv4: [&ep["IPAMConfig"]["IPv4Address"], &ep["IPAddress"]]
                            .into_iter()
                            .find_map(|a| a.as_str().filter(|s| !s.is_empty()))
                            .map(str::to_owned),
                        // Docker adds the short id itself on connect.
                        aliases: ep["Aliases"]
                            .as_array()
                            .into_iter()
                            .flatten()
                            .filter_map(Value::as_str)
                            .filter(|a| !(a.len() >= 12 && id.starts_with(a)))
                            .map(str::to_owned)
                            .collect(),
                    })
                    .collect()
            })
            .unwrap_or_default();
        State {
            running: v["State"]["Running"].as_bool().unwrap_or(false),
            paused: v["State"]["Paused"].as_bool().unwrap_or(false),
            netns_of: mode.strip_prefix("container:").map(str::to_owned),
            endpoints,
        }
    }

    /// Not running, frozen, or (with its own network stack) on no network.
    fn down(&self) -> bool {
        !self.running || self.paused || (self.netns_of.is_none() && self.endpoints.is_empty())
    }
}

/// Aborts the connection task when the call ends, timed out or not.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Percent-encodes a query value (everything but RFC 3986's unreserved characters).
fn encode_query(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// The engine's own message from an error answer (`{"message": ...}`), or the body.
fn engine_message(body: &[u8]) -> String {
    serde_json::from_slice::<Value>(body)
        .ok()
        .and_then(|v| v["message"].as_str().map(str::to_owned))
        .unwrap_or_else(|| String::from_utf8_lossy(body).trim().to_owned())
}

impl DockerDriver {
    /// A driver for `project`'s containers on the engine at `socket`.
    pub fn new(socket: impl Into<PathBuf>, project: impl Into<String>) -> DockerDriver {
        DockerDriver { socket: socket.into(), project: project.into(), detached: Mutex::new(HashMap::new()) }
    }

    /// A driver for the project named by `$BENCH_COMPOSE_PROJECT`, else
    /// [`DEFAULT_PROJECT`] (the docs' `-p lab`).
    pub fn from_env(socket: impl Into<PathBuf>) -> DockerDriver {
        let project = std::env::var(PROJECT_ENV).ok().filter(|p| !p.is_empty());
        DockerDriver::new(socket, project.unwrap_or_else(|| DEFAULT_PROJECT.to_owned()))
    }

    /// One engine call: its status and body, whatever the status.
    async fn raw(&self, method: Method, path: &str, body: Option<&Value>) -> anyhow::Result<(StatusCode, Bytes)> {
        let call = async {
            let stream = UnixStream::connect(&self.socket).await.with_context(|| {
                format!("cannot reach the Docker engine at {} (is its socket mounted here?)", self.socket.display())
            })?;
            let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
            let _conn = AbortOnDrop(tokio::spawn(async move {
                let _ = conn.await;
            }));
            let body = body.map(|b| Bytes::from(b.to_string())).unwrap_or_default();
            // The engine (Go's HTTP server) refuses an HTTP/1.1 request without Host.
            let req = Request::builder()
                .method(method.clone())
                .uri(path)
                .header(HOST, "docker")
                .header(CONTENT_TYPE, "application/json")
                .body(Full::new(body))?;
            let resp = sender.send_request(req).await?;
            let status = resp.status();
            let bytes = resp.into_body().collect().await?.to_bytes();
            anyhow::Ok((status, bytes))
        };
        match tokio::time::timeout(CALL_TIMEOUT, call).await {
            Ok(r) => r.with_context(|| format!("Docker engine at {}: {method} {path}", self.socket.display())),
            Err(_) => bail!(
                "Docker engine at {}: {method} {path}: no answer in {} s",
                self.socket.display(),
                CALL_TIMEOUT.as_secs()
            ),
        }
    }

    /// One engine call that must answer with one of `ok`; otherwise an error
    /// carrying the engine's message. The body parsed as JSON (null if empty).
    async fn call(&self, method: Method, path: &str, body: Option<&Value>, ok: &[StatusCode]) -> anyhow::Result<Value> {
        let (status, bytes) = self.raw(method.clone(), path, body).await?;
        if !ok.contains(&status) {
            bail!("Docker engine: {method} {path}: {status}: {}", engine_message(&bytes));
        }
        if bytes.is_empty() {
            return Ok(Value::Null);
        }
        serde_json::from_slice(&bytes)
            .with_context(|| format!("Docker engine: {method} {path}: the answer is not JSON"))
    }

    /// Containers (id, first name) with the given labels (`key=value` or `key`), oneoff runs left out.
    async fn list(&self, labels: &[String]) -> anyhow::Result<Vec<(String, String, Value)>> {
        let filters = json!({ "label": labels }).to_string();
        let path = format!("/containers/json?all=true&filters={}", encode_query(&filters));
        let v = self.call(Method::GET, &path, None, &[StatusCode::OK]).await?;
        Ok(v.as_array()
            .into_iter()
            .flatten()
            .filter(|c| !c["Labels"][ONEOFF_LABEL].as_str().is_some_and(|o| o.eq_ignore_ascii_case("true")))
            .map(|c| {
                let id = c["Id"].as_str().unwrap_or_default().to_owned();
                let name = c["Names"][0].as_str().unwrap_or(&id).trim_start_matches('/').to_owned();
                (id, name, c["Labels"].clone())
            })
            .collect())
    }

    /// The id of the one container of the fault's Compose service; an error
    /// naming what exists when there is none (or several).
    async fn container(&self, f: &Fault) -> anyhow::Result<String> {
        let service = f.compose_service();
        let found = self
            .list(&[format!("{PROJECT_LABEL}={}", self.project), format!("{SERVICE_LABEL}={service}")])
            .await
            .with_context(|| format!("{f}: looking for its container"))?;
        match found.as_slice() {
            [(id, _, _)] => Ok(id.clone()),
            [] => Err(self.not_found(f, &service).await),
            many => bail!(
                "{f}: {} containers of Compose service {service} in project {} ({}); a fault needs exactly one",
                many.len(),
                self.project,
                many.iter().map(|(_, n, _)| n.as_str()).collect::<Vec<_>>().join(", ")
            ),
        }
    }

    /// Why no container matched: the project's services, or the projects there are.
    async fn not_found(&self, f: &Fault, service: &str) -> anyhow::Error {
        let label = |all: &[(String, String, Value)], key: &str| -> BTreeSet<String> {
            all.iter().filter_map(|(_, _, l)| l[key].as_str().map(str::to_owned)).collect()
        };
        let hint = match self.list(&[format!("{PROJECT_LABEL}={}", self.project)]).await {
            Ok(ours) if !ours.is_empty() => {
                let services: Vec<_> = label(&ours, SERVICE_LABEL).into_iter().collect();
                format!("project {} has the services {}", self.project, services.join(", "))
            }
            Ok(_) => match self.list(&[PROJECT_LABEL.to_owned()]).await {
                Ok(any) if !any.is_empty() => {
                    let projects: Vec<_> = label(&any, PROJECT_LABEL).into_iter().collect();
                    format!(
                        "project {} has no containers; the Compose projects on this engine are {} ({PROJECT_ENV} names the project)",
                        self.project,
                        projects.join(", ")
                    )
                }
                _ => format!("there are no Compose containers on this engine (project {})", self.project),
            },
            Err(e) => format!("{e:#}"),
        };
        anyhow!("{f}: no container of Compose service {service} in project {}: {hint}", self.project)
    }

    async fn state(&self, id: &str) -> anyhow::Result<State> {
        let v = self.call(Method::GET, &format!("/containers/{id}/json"), None, &[StatusCode::OK]).await?;
        Ok(State::from_inspect(id, &v))
    }

    /// Takes the container off every network it is on, remembering each
    /// network, address and aliases for [`DockerDriver::reconnect`].
    async fn disconnect(&self, f: &Fault, id: &str) -> anyhow::Result<()> {
        let st = self.state(id).await?;
        if let Some(holder) = st.netns_of {
            bail!("{f}: the container shares the network namespace of {holder}; partition that one");
        }
        if st.endpoints.is_empty() {
            bail!("{f}: the node is on no network already (partitioned before?)");
        }
        for ep in st.endpoints {
            let body = json!({ "Container": id, "Force": true });
            self.call(Method::POST, &format!("/networks/{}/disconnect", ep.network_id), Some(&body), &[StatusCode::OK])
                .await
                .with_context(|| format!("{f}: disconnecting from network {}", ep.network_name))?;
            self.detached.lock().unwrap_or_else(|e| e.into_inner()).entry(id.to_owned()).or_default().push(ep);
        }
        Ok(())
    }

    /// Puts the container back on the networks [`DockerDriver::disconnect`]
    /// took it off, with the same IPv4 address and aliases.
    async fn reconnect(&self, f: &Fault, id: &str) -> anyhow::Result<()> {
        let remembered = self.detached.lock().unwrap_or_else(|e| e.into_inner()).get(id).cloned().unwrap_or_default();
        let st = self.state(id).await?;
        if remembered.is_empty() {
            if st.endpoints.is_empty() && st.netns_of.is_none() {
                bail!(
                    "{f}: the node is on no network, and not by this run's doing, so its address is unknown; \
                     reconnect it by hand (docker network connect --ip ADDRESS NETWORK CONTAINER)"
                );
            }
            return Ok(());
        }
        for ep in remembered {
            if !st.endpoints.iter().any(|e| e.network_id == ep.network_id || e.network_name == ep.network_name) {
                let mut config = json!({ "Aliases": ep.aliases });
                if let Some(ip) = &ep.ipv4 {
                    config["IPAMConfig"] = json!({ "IPv4Address": ip });
                }
                let body = json!({ "Container": id, "EndpointConfig": config });
                self.call(
                    Method::POST,
                    &format!("/networks/{}/connect", ep.network_id),
                    Some(&body),
                    &[StatusCode::OK],
                )
                .await
                .with_context(|| {
                    format!("{f}: reconnecting to network {} as {}", ep.network_name, ep.ipv4.as_deref().unwrap_or("?"))
                })?;
            }
            let mut detached = self.detached.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(list) = detached.get_mut(id) {
                list.retain(|e| e.network_id != ep.network_id);
                if list.is_empty() {
                    detached.remove(id);
                }
            }
        }
        Ok(())
    }
}

#[async_trait::async_trait]
impl FaultDriver for DockerDriver {
    fn describe(&self) -> String {
        format!("Docker engine at {}, Compose project {}", self.socket.display(), self.project)
    }

    async fn inject(&self, f: &Fault) -> anyhow::Result<()> {
        let id = self.container(f).await?;
        let post = |what: &str| format!("/containers/{id}/{what}");
        match f.kind {
            FaultKind::Kill => {
                self.call(Method::POST, &post("kill?signal=KILL"), None, &[StatusCode::NO_CONTENT]).await?;
            }
            FaultKind::Pause => {
                self.call(Method::POST, &post("pause"), None, &[StatusCode::NO_CONTENT]).await?;
            }
            FaultKind::Partition => self.disconnect(f, &id).await?,
        }
        Ok(())
    }

    async fn heal(&self, f: &Fault) -> anyhow::Result<()> {
        let id = self.container(f).await?;
        match f.kind {
            // 304: it runs already.
            FaultKind::Kill => {
                let ok = [StatusCode::NO_CONTENT, StatusCode::NOT_MODIFIED];
                self.call(Method::POST, &format!("/containers/{id}/start"), None, &ok).await?;
            }
            FaultKind::Pause => {
                if self.state(&id).await?.paused {
                    self.call(Method::POST, &format!("/containers/{id}/unpause"), None, &[StatusCode::NO_CONTENT])
                        .await?;
                }
            }
            FaultKind::Partition => self.reconnect(f, &id).await?,
        }
        Ok(())
    }

    async fn is_down(&self, f: &Fault) -> anyhow::Result<bool> {
        let id = self.container(f).await?;
        let st = self.state(&id).await?;
        if st.down() {
            return Ok(true);
        }
        // A service is down with the node holding its network namespace.
        match &st.netns_of {
            Some(holder) => Ok(self.state(holder).await?.down()),
            None => Ok(false),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_values_are_percent_encoded() {
        assert_eq!(encode_query(r#"{"label":["a=b"]}"#), "%7B%22label%22%3A%5B%22a%3Db%22%5D%7D");
        assert_eq!(encode_query("node02-ls_1.x~"), "node02-ls_1.x~");
    }

    #[test]
    fn the_engine_message_is_taken_from_its_json() {
        assert_eq!(engine_message(br#"{"message":"No such container: x"}"#), "No such container: x");
        assert_eq!(engine_message(b"plain text\n"), "plain text");
    }

    #[test]
    fn inspect_gives_state_networks_addresses_and_the_namespace_holder() {
        let id = "0123456789abcdef";
        let v = json!({
            "State": { "Running": true, "Paused": false },
            "HostConfig": { "NetworkMode": "lab_lab" },
            "NetworkSettings": { "Networks": { "lab_lab": {
                "NetworkID": "feed", "IPAddress": "10.89.0.12",
                "IPAMConfig": { "IPv4Address": "10.89.0.12" }, "Aliases": ["node02", "0123456789ab"]
            } } }
        });
        let st = State::from_inspect(id, &v);
        assert!(!st.down());
        assert_eq!(st.endpoints.len(), 1);
        let ep = &st.endpoints[0];
        assert_eq!((ep.network_id.as_str(), ep.network_name.as_str()), ("feed", "lab_lab"));
        assert_eq!((ep.ipv4.as_deref(), ep.aliases.clone()), (Some("10.89.0.12"), vec!["node02".to_owned()]));

        let v = json!({
            "State": { "Running": true, "Paused": true },
            "HostConfig": { "NetworkMode": "container:abc" },
            "NetworkSettings": { "Networks": {} }
        });
        let st = State::from_inspect(id, &v);
        assert_eq!(st.netns_of.as_deref(), Some("abc"));
        assert!(st.down(), "paused is down");
        let v = json!({ "State": { "Running": true }, "HostConfig": { "NetworkMode": "lab_lab" },
                        "NetworkSettings": { "Networks": {} } });
        assert!(State::from_inspect(id, &v).down(), "on no network is down");
        let v = json!({ "State": { "Running": false }, "HostConfig": { "NetworkMode": "container:abc" } });
        assert!(State::from_inspect(id, &v).down(), "stopped is down");
    }

    #[test]
    fn describe_names_the_socket_and_project() {
        assert_eq!(
            DockerDriver::new("/var/run/docker.sock", "lab").describe(),
            "Docker engine at /var/run/docker.sock, Compose project lab"
        );
    }
}
