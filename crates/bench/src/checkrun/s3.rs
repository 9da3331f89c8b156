//! The S3 workloads' clients. `s3-register`: each client PUTs unique values
//! to a few keys and GETs them, each request through an endpoint picked at
//! random. `s3-set`: each client PUTs objects under unique keys (the set's
//! elements); once the faults are healed every endpoint lists them.
//! Every request is one attempt (no SDK retries), recorded with its
//! endpoint and outcome.

use super::record::{Recorder, chain, classify};
use crate::check::history::{Op, Operation, Outcome};
use aws_sdk_s3::Client;
use std::time::{Duration, Instant};

/// An S3 API to check: clients by endpoint label, one bucket, and the
/// prefix of this run's keys.
#[derive(Debug, Clone)]
pub struct S3Api {
    /// (label for the history, client), one per endpoint.
    pub endpoints: Vec<(String, Client)>,
    pub bucket: String,
    /// Every key this run makes starts with it (a run id, so runs against
    /// the same bucket do not see each other's keys).
    pub prefix: String,
}

/// What a client does between two requests, and how many it makes at most.
#[derive(Debug, Clone, Copy)]
pub struct Pace {
    /// Pause after each request (keeps histories small enough to search).
    pub think: Duration,
    /// Most requests per client.
    pub max_ops: usize,
}

impl S3Api {
    /// The register key `k`.
    pub fn register_key(&self, k: usize) -> String {
        format!("{}r{k}", self.prefix)
    }

    fn set_prefix(&self) -> String {
        format!("{}set/", self.prefix)
    }

    fn pick(&self, rng: &mut u64) -> usize {
        (crate::loadgen::xorshift(rng) % self.endpoints.len() as u64) as usize
    }

    /// Creates the bucket unless an endpoint already has it; tries each
    /// endpoint, a few rounds.
    pub async fn ensure_bucket(&self) -> anyhow::Result<()> {
        let mut last = None;
        for round in 0..5 {
            for (label, c) in &self.endpoints {
                if c.head_bucket().bucket(&self.bucket).send().await.is_ok() {
                    return Ok(());
                }
                match c.create_bucket().bucket(&self.bucket).send().await {
                    Ok(_) => return Ok(()),
                    Err(e) => last = Some(format!("creating bucket {} via {label}: {}", self.bucket, chain(&e))),
                }
            }
            tokio::time::sleep(Duration::from_millis(200 * (round + 1))).await;
        }
        anyhow::bail!(last.unwrap_or_else(|| "no S3 endpoints".into()))
    }

    /// Waits (at most `limit`) until every endpoint answers a HEAD of the
    /// bucket; returns the endpoints that never did.
    pub async fn wait_ready(&self, limit: Duration) -> Vec<String> {
        let until = Instant::now() + limit;
        let mut waiting: Vec<usize> = (0..self.endpoints.len()).collect();
        while !waiting.is_empty() && Instant::now() < until {
            let mut still = Vec::new();
            for i in waiting {
                if self.endpoints[i].1.head_bucket().bucket(&self.bucket).send().await.is_err() {
                    still.push(i);
                }
            }
            waiting = still;
            if !waiting.is_empty() {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
        waiting.into_iter().map(|i| self.endpoints[i].0.clone()).collect()
    }

    async fn put(&self, e: usize, key: &str, body: &str) -> (Outcome, Option<String>) {
        let c = &self.endpoints[e].1;
        match c.put_object().bucket(&self.bucket).key(key).body(body.as_bytes().to_vec().into()).send().await {
            Ok(_) => (Outcome::Ok, None),
            Err(err) => {
                let (o, why, _) = classify(&err);
                (o, Some(why))
            }
        }
    }

    /// A GET: Ok with the value (None when absent), or the failure.
    async fn get(&self, e: usize, key: &str) -> (Outcome, Option<String>, Option<String>) {
        let c = &self.endpoints[e].1;
        match c.get_object().bucket(&self.bucket).key(key).send().await {
            Ok(resp) => match resp.body.collect().await {
                Ok(b) => (Outcome::Ok, Some(String::from_utf8_lossy(&b.into_bytes()).into_owned()), None),
                Err(err) => (Outcome::Indeterminate, None, Some(format!("body: {}", chain(&err)))),
            },
            Err(err) => match classify(&err) {
                (_, _, Some(404)) => (Outcome::Ok, None, None),
                (o, why, _) => (o, None, Some(why)),
            },
        }
    }

    /// Every key under the set's prefix, page by page.
    async fn list(&self, e: usize) -> Result<Vec<String>, (Outcome, String)> {
        let c = &self.endpoints[e].1;
        let mut keys = Vec::new();
        let mut token: Option<String> = None;
        for _ in 0..100_000 {
            let req = c.list_objects_v2().bucket(&self.bucket).prefix(self.set_prefix()).set_continuation_token(token);
            let page = req.send().await.map_err(|err| {
                let (o, why, _) = classify(&err);
                (o, why)
            })?;
            keys.extend(page.contents().iter().filter_map(|o| o.key().map(str::to_owned)));
            token = page.next_continuation_token().map(str::to_owned);
            if !page.is_truncated().unwrap_or(false) || token.is_none() {
                return Ok(keys);
            }
        }
        Err((Outcome::Indeterminate, "listing did not end".into()))
    }

    /// Records one finished request; false once the history is full.
    fn record(
        &self,
        rec: &Recorder,
        process: u32,
        e: usize,
        invoke: u64,
        op: Op,
        result: (Outcome, Option<String>),
    ) -> bool {
        let (outcome, error) = result;
        let endpoint = self.endpoints[e].0.clone();
        rec.op(Operation { process, endpoint, invoke, complete: rec.now(), op, outcome, error })
    }

    /// One `s3-register` client until `deadline`.
    pub async fn register_client(
        &self,
        rec: &Recorder,
        process: u32,
        seed: u64,
        keys: usize,
        pace: Pace,
        deadline: Instant,
    ) {
        let mut rng = (seed ^ (u64::from(process) + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15)) | 1;
        for n in 0..pace.max_ops {
            if Instant::now() >= deadline {
                break;
            }
            let e = self.pick(&mut rng);
            let key = self.register_key((crate::loadgen::xorshift(&mut rng) % keys.max(1) as u64) as usize);
            let invoke = rec.now();
            let kept = if crate::loadgen::xorshift(&mut rng).is_multiple_of(2) {
                let value = format!("{process}-{n}");
                let (outcome, error) = self.put(e, &key, &value).await;
                self.record(rec, process, e, invoke, Op::Write { key, value }, (outcome, error))
            } else {
                let (outcome, value, error) = self.get(e, &key).await;
                self.record(rec, process, e, invoke, Op::Read { key, value }, (outcome, error))
            };
            if !kept {
                break;
            }
            tokio::time::sleep(pace.think).await;
        }
    }

    /// After healing: every key read through every endpoint.
    pub async fn final_register_reads(&self, rec: &Recorder, process: u32, keys: usize) {
        for k in 0..keys {
            let key = self.register_key(k);
            for e in 0..self.endpoints.len() {
                let invoke = rec.now();
                let (outcome, value, error) = self.get(e, &key).await;
                self.record(rec, process, e, invoke, Op::Read { key: key.clone(), value }, (outcome, error));
            }
        }
    }

    /// One `s3-set` client until `deadline`.
    pub async fn set_client(&self, rec: &Recorder, process: u32, seed: u64, pace: Pace, deadline: Instant) {
        let mut rng = (seed ^ (u64::from(process) + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15)) | 1;
        for n in 0..pace.max_ops {
            if Instant::now() >= deadline {
                break;
            }
            let e = self.pick(&mut rng);
            let element = format!("{}{process}-{n}", self.set_prefix());
            let invoke = rec.now();
            let (outcome, error) = self.put(e, &element, "x").await;
            if !self.record(rec, process, e, invoke, Op::SetAdd { element }, (outcome, error)) {
                break;
            }
            tokio::time::sleep(pace.think).await;
        }
    }

    /// After healing: the set listed through every endpoint (a failed
    /// listing is retried a few times, each attempt recorded).
    pub async fn final_set_reads(&self, rec: &Recorder, process: u32) {
        for e in 0..self.endpoints.len() {
            for attempt in 0..5u64 {
                let invoke = rec.now();
                let (op, outcome, error) = match self.list(e).await {
                    Ok(elements) => (Op::SetRead { elements }, Outcome::Ok, None),
                    Err((o, why)) => (Op::SetRead { elements: Vec::new() }, o, Some(why)),
                };
                self.record(rec, process, e, invoke, op, (outcome, error));
                if outcome == Outcome::Ok {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(500 * (attempt + 1))).await;
            }
        }
    }
}
