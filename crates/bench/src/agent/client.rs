//! The coordinator's typed client for one agent.

use super::{
    AgentInfo, CleanupRequest, ErrorBody, Iperf3ClientRequest, Iperf3Reply, Iperf3ServerReply, Iperf3ServerRequest,
    JobReply, JobRequest, ObjectsReply, ObjectsRequest, PatternReply, PatternRequest, ProbeReply, ProbeRequest,
    SteadyReply, SteadyRequest,
};
use anyhow::Context;
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::net::SocketAddr;
use std::time::Duration;

/// One agent, by name and address.
#[derive(Debug, Clone)]
pub struct AgentClient {
    /// The role-file name (`node04`, `worker-a`).
    pub name: String,
    /// Its HTTP address.
    pub addr: SocketAddr,
    token: String,
    http: reqwest::Client,
}

impl AgentClient {
    pub fn new(name: &str, addr: SocketAddr, token: &str) -> AgentClient {
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(5))
            // Work runs inside the call; the agent bounds it (MAX_WORK).
            .timeout(super::MAX_WORK + Duration::from_secs(60))
            .build()
            .unwrap_or_default();
        AgentClient { name: name.into(), addr, token: token.into(), http }
    }

    async fn call<Q: Serialize, R: DeserializeOwned>(
        &self,
        method: &str,
        path: &str,
        q: Option<&Q>,
    ) -> anyhow::Result<R> {
        let url = format!("http://{}{path}", self.addr);
        let req = match method {
            "GET" => self.http.get(&url),
            _ => self.http.post(&url),
        };
        let req = req.bearer_auth(&self.token);
        let req = match q {
            Some(q) => req.json(q),
            None => req,
        };
        let resp = req.send().await.with_context(|| format!("agent {} ({}): {path}", self.name, self.addr))?;
        let status = resp.status();
        let bytes = resp.bytes().await.with_context(|| format!("agent {}: reading the answer to {path}", self.name))?;
        if !status.is_success() {
            let why = serde_json::from_slice::<ErrorBody>(&bytes)
                .map(|e| e.error)
                .unwrap_or_else(|_| String::from_utf8_lossy(&bytes).into_owned());
            anyhow::bail!("agent {} ({}): {path} answered {status}: {why}", self.name, self.addr);
        }
        serde_json::from_slice(&bytes)
            .with_context(|| format!("agent {}: {path} answered something unexpected", self.name))
    }

    pub async fn info(&self) -> anyhow::Result<AgentInfo> {
        self.call::<(), _>("GET", "/v1/info", None).await
    }

    /// The sink's address as reachable at this agent's host.
    pub fn sink(&self, info: &AgentInfo) -> SocketAddr {
        SocketAddr::new(self.addr.ip(), info.sink_port)
    }

    pub async fn job(&self, r: &JobRequest) -> anyhow::Result<JobReply> {
        self.call("POST", "/v1/job", Some(r)).await
    }

    pub async fn pattern(&self, r: &PatternRequest) -> anyhow::Result<PatternReply> {
        self.call("POST", "/v1/pattern", Some(r)).await
    }

    pub async fn objects(&self, r: &ObjectsRequest) -> anyhow::Result<ObjectsReply> {
        self.call("POST", "/v1/objects", Some(r)).await
    }

    pub async fn steady(&self, r: &SteadyRequest) -> anyhow::Result<SteadyReply> {
        self.call("POST", "/v1/steady", Some(r)).await
    }

    pub async fn probe(&self, r: &ProbeRequest) -> anyhow::Result<ProbeReply> {
        self.call("POST", "/v1/probe", Some(r)).await
    }

    pub async fn iperf3_server(&self) -> anyhow::Result<u16> {
        let r: Iperf3ServerReply =
            self.call("POST", "/v1/iperf3/server", Some(&Iperf3ServerRequest { port: 0 })).await?;
        Ok(r.port)
    }

    pub async fn iperf3_client(&self, r: &Iperf3ClientRequest) -> anyhow::Result<Iperf3Reply> {
        self.call("POST", "/v1/iperf3/client", Some(r)).await
    }

    pub async fn cleanup(&self) -> anyhow::Result<()> {
        let _: serde_json::Value = self.call("POST", "/v1/cleanup", Some(&CleanupRequest {})).await?;
        Ok(())
    }
}
