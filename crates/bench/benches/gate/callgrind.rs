//! Callgrind's start/stop-instrumentation client requests, so a benchmark
//! counts exactly its measured operation: on every thread (the S3 engine
//! hashes and writes blocks on tokio's blocking threads) and nothing of its
//! setup. Outside Valgrind the magic sequence does nothing.
//!
//! Written out here rather than taken from gungraun's `client_requests`
//! feature, whose build runs bindgen and needs libclang.

/// `VG_USERREQ_TOOL_BASE('C', 'T')` in valgrind/callgrind.h.
const BASE: u64 = ((b'C' as u64) << 24) | ((b'T' as u64) << 16);
const START_INSTRUMENTATION: u64 = BASE + 4;
const STOP_INSTRUMENTATION: u64 = BASE + 5;

#[cfg(target_arch = "x86_64")]
fn request(code: u64) {
    let args: [u64; 6] = [code, 0, 0, 0, 0, 0];
    let mut result: u64 = 0;
    // SAFETY: Valgrind's client-request sequence for amd64 (valgrind.h,
    // VALGRIND_DO_CLIENT_REQUEST_EXPR): four rotations of rdi that add up to
    // 128 bits leave it unchanged and `xchg rbx, rbx` is a no-op, so on a real
    // CPU nothing changes; under Valgrind it reads `args` (alive on the stack
    // for the call) and writes the result to rdx.
    unsafe {
        std::arch::asm!(
            "rol rdi, 3",
            "rol rdi, 13",
            "rol rdi, 61",
            "rol rdi, 51",
            "xchg rbx, rbx",
            in("rax") args.as_ptr(),
            inout("rdx") result,
            inout("rdi") 0u64 => _,
            options(nostack),
        );
    }
    std::hint::black_box(result);
}

#[cfg(not(target_arch = "x86_64"))]
fn request(_code: u64) {
    compile_error!("the gate's Callgrind client requests are written for x86_64 only");
}

/// Runs `f` with Callgrind's instrumentation on and returns its result.
#[inline(never)]
pub fn measure<T>(f: impl FnOnce() -> T) -> T {
    request(START_INSTRUMENTATION);
    let out = f();
    request(STOP_INSTRUMENTATION);
    out
}
