//! Records the commit the bench is built from (`BENCH_COMMIT`, for the
//! report's conditions). Outside a git checkout it is `unknown`, unless
//! `BENCH_COMMIT` is set in the build's environment.

use std::path::PathBuf;
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let o = Command::new("git").args(args).output().ok()?;
    o.status.success().then(|| String::from_utf8_lossy(&o.stdout).trim().to_owned())
}

fn main() {
    println!("cargo:rerun-if-env-changed=BENCH_COMMIT");
    println!("cargo:rerun-if-changed=build.rs");
    let commit = std::env::var("BENCH_COMMIT").ok().filter(|c| !c.is_empty()).or_else(|| {
        let c = git(&["rev-parse", "--short=12", "HEAD"])?;
        // Rebuild when HEAD moves: watch HEAD, the branch it names and packed-refs
        // (only files that exist, so a missing one does not force a rerun each build).
        let git_dir = PathBuf::from(git(&["rev-parse", "--absolute-git-dir"])?);
        let common = git(&["rev-parse", "--git-common-dir"])
            .map(PathBuf::from)
            .map(|p| if p.is_absolute() { p } else { std::env::current_dir().unwrap_or_default().join(p) });
        let mut watch = vec![git_dir.join("HEAD")];
        if let Some(r) = git(&["symbolic-ref", "-q", "HEAD"]) {
            watch.push(git_dir.join(&r));
            if let Some(c) = &common {
                watch.push(c.join(&r));
                watch.push(c.join("packed-refs"));
            }
        }
        for p in watch.iter().filter(|p| p.exists()) {
            println!("cargo:rerun-if-changed={}", p.display());
        }
        Some(c)
    });
    println!("cargo:rustc-env=BENCH_COMMIT={}", commit.unwrap_or_else(|| "unknown".into()));
}
