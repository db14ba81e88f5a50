//! Build script: compiles the sockmap program in bpf/ for the BPF target with clang into
//! OUT_DIR, where src/l4/sockmap.rs embeds it. Without clang (or when the compile fails) it
//! writes an empty object and prints a cargo warning: kvlb still builds, and selecting the
//! sockmap forwarding then falls back to splice at run time with one log line.

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("OUT_DIR is set by cargo"));
    let object = out.join("sockmap.bpf.o");
    let source = Path::new("bpf/sockmap.bpf.c");
    for watched in [
        "bpf/sockmap.bpf.c",
        "bpf/include/kvlb_maps.h",
        "bpf/include/kvlb_bpf.h",
    ] {
        println!("cargo:rerun-if-changed={watched}");
    }
    println!("cargo:rerun-if-env-changed=KVLB_CLANG");
    let clang = std::env::var("KVLB_CLANG").unwrap_or_else(|_| "clang".to_string());

    let mut cmd = Command::new(&clang);
    cmd.args(["-O2", "-g", "-target", "bpf", "-Wall", "-Werror"]);
    // linux/bpf.h includes asm/types.h, which Debian keeps in the multiarch include directory
    // that clang does not search for the bpf target.
    let arch = std::env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_default();
    let multiarch = format!("/usr/include/{arch}-linux-gnu");
    if Path::new(&multiarch).is_dir() {
        cmd.arg(format!("-I{multiarch}"));
    }
    cmd.arg("-c").arg(source).arg("-o").arg(&object);
    let failure = match cmd.output() {
        Ok(o) if o.status.success() => None,
        Ok(o) => Some(format!(
            "{clang} failed to compile {}: {}",
            source.display(),
            String::from_utf8_lossy(&o.stderr).trim()
        )),
        Err(e) => Some(format!("{clang} not found ({e})")),
    };
    if let Some(why) = failure {
        println!(
            "cargo:warning=the sockmap program was not built ({}); l4_forwarding = \"sockmap\" will fall back to splice",
            why.lines().next().unwrap_or("")
        );
        std::fs::write(&object, b"").expect("write an empty sockmap object");
    }
}
