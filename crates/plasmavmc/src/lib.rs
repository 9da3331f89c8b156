//! PlasmaVMC: VM images stored in LightningStor, volumes made from them in
//! CoronaFS, and emulated VMs that attach and migrate.
//!
//! Layers, bottom up; a module imports only from layers below it (the
//! `module_imports_form_no_cycle` test below checks there is no circle):
//! 1. [`error`], [`probe`], [`urlfilter`], [`wire`], [`model`], [`config`],
//!    [`locks`], [`meta`], [`metrics`]: the error type, sans-IO checks of
//!    untrusted input (image headers, import URLs, names), the agent's and
//!    the REST API's DTOs, configuration, the redb tables;
//! 2. engines: [`convert`], [`sink`] (qcow2/raw to guest bytes, and NBD
//!    writes of them), [`objstore`], [`corona`] (clients of LightningStor and
//!    CoronaFS), [`reconnect`] (a volume connection that survives failovers),
//!    [`guest`] (an emulated guest), [`worker`] (the [`Worker`]
//!    trait: in-process, or a `plasmavmc agent` over HTTP), [`client`] (the
//!    typed client of the REST API);
//! 3. [`app`]: the shared state and start-up recovery;
//! 4. services: [`images`], [`cache`], [`volumes`], [`vms`];
//! 5. front ends: [`api`], [`openapi`], [`server`] (the REST API and its
//!    in-process server), [`agent`] (the agent's HTTP server) and [`front`]
//!    (`plasmavmc nbd-front`, a local NBD export that survives failovers);
//! 6. `main.rs`: the CLI.
//!
//! [`Worker`]: worker::Worker

pub mod agent;
pub mod api;
pub mod app;
pub mod cache;
pub mod client;
pub mod config;
pub mod convert;
pub mod corona;
pub mod error;
#[cfg(test)]
mod failover_tests;
pub mod front;
pub mod guest;
pub mod images;
pub mod locks;
pub mod meta;
pub mod metrics;
pub mod model;
pub mod objstore;
pub mod openapi;
pub mod probe;
pub mod reconnect;
pub mod server;
pub mod sink;
pub mod urlfilter;
pub mod vms;
pub mod volumes;
pub mod wire;
pub mod worker;

pub use config::Config;
pub use error::{PlasmaError, Result};
pub use server::Server;

#[cfg(test)]
mod layering {
    use std::collections::{BTreeMap, BTreeSet};

    /// Each module's `crate::` imports (comments left out), by module.
    fn imports() -> BTreeMap<String, BTreeSet<String>> {
        let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        let mut dirs = vec![src.clone()];
        while let Some(d) = dirs.pop() {
            for e in std::fs::read_dir(&d).expect("read src").flatten() {
                let p = e.path();
                if p.is_dir() {
                    dirs.push(p);
                    continue;
                }
                let rel = p.strip_prefix(&src).expect("under src").to_string_lossy().into_owned();
                if !rel.ends_with(".rs") || rel == "lib.rs" || rel == "main.rs" {
                    continue;
                }
                let module = rel.split('/').next().unwrap_or_default().trim_end_matches(".rs").to_owned();
                let text: String = std::fs::read_to_string(&p)
                    .expect("read")
                    .lines()
                    .map(|l| l.split("//").next().unwrap_or_default())
                    .collect::<Vec<_>>()
                    .join("\n");
                let deps = out.entry(module.clone()).or_default();
                for (i, _) in text.match_indices("crate::") {
                    let rest = &text[i + 7..];
                    let names: Vec<&str> = match rest.strip_prefix('{') {
                        Some(list) => list.split('}').next().unwrap_or_default().split(',').collect(),
                        None => vec![rest],
                    };
                    for n in names {
                        let n: String = n.trim().chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
                        if !n.is_empty() && n != module {
                            deps.insert(n);
                        }
                    }
                }
            }
        }
        out
    }

    #[test]
    fn module_imports_form_no_cycle() {
        let graph = imports();
        assert!(graph.contains_key("vms") && graph.contains_key("worker"), "{graph:?}");
        // Peel off modules that import nothing left, or that nothing left
        // imports; what remains are the circles.
        let mut left = graph.clone();
        loop {
            let free: Vec<String> = left
                .iter()
                .filter(|(m, deps)| {
                    deps.iter().all(|d| !left.contains_key(d)) || left.values().all(|other| !other.contains(*m))
                })
                .map(|(m, _)| m.clone())
                .collect();
            if free.is_empty() {
                break;
            }
            for m in free {
                left.remove(&m);
            }
        }
        assert!(left.is_empty(), "modules importing each other (directly or in a circle): {left:?}");
    }

    #[test]
    fn the_bottom_layer_imports_nothing_above_it() {
        let graph = imports();
        let bottom = ["error", "probe", "urlfilter", "wire", "model", "config", "locks", "meta", "metrics"];
        for m in bottom {
            let deps = graph.get(m).unwrap_or_else(|| panic!("no module {m}"));
            let above: Vec<&String> = deps.iter().filter(|d| !bottom.contains(&d.as_str())).collect();
            assert!(above.is_empty(), "{m} imports {above:?} from above the bottom layer");
        }
    }
}
