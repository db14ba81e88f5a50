//! No import cycles between modules: in every crate of the workspace (`src/` and
//! `crates/*/src/`), the modules under one parent (the crate's top-level modules, the files of
//! one directory) must form a DAG through their `crate::`, `super::` and `self::` paths.
//! Cargo already forbids cycles between crates; this is the same rule one level down.
//!
//! A reference from module `a::b::x` to `a::c::y` is an edge `b -> c` among the children of
//! `a`; references between a module and its own ancestors or descendants are not edges (a
//! parent declares its children, and children use their parent's items). Paths are read from
//! the source with comments and string literals removed, `use` trees expanded, and resolved
//! to the longest prefix that is a module file of that crate, so `crate::select` where
//! `select` is another crate re-exported at the root is not an edge of this crate.
//!
//! Known cycles being broken elsewhere are listed in `KNOWN_CYCLES`, the one place to empty.

#![forbid(unsafe_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Cycles known and tolerated until their fix lands; a cycle found must be one of these or part
/// of one. Empty it, do not add to it: an entry that no longer matches any cycle fails the test
/// so it is removed.
/// (crate source directory, parent module (`""` = the crate root), the modules of the cycle)
const KNOWN_CYCLES: &[(&str, &str, &[&str])] = &[];

type ModPath = Vec<String>;

/// Source with comments removed and string and char literals emptied.
fn strip(src: &str) -> String {
    let b = src.as_bytes();
    let mut out = String::with_capacity(src.len());
    let mut i = 0;
    let ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_';
    while i < b.len() {
        if b[i..].starts_with(b"//") {
            i = src[i..].find('\n').map_or(b.len(), |j| i + j);
            continue;
        }
        if b[i..].starts_with(b"/*") {
            i = src[i + 2..].find("*/").map_or(b.len(), |j| i + 2 + j + 2);
            continue;
        }
        // Raw strings: r"..", r#".."#, br"..".
        if (b[i] == b'r' || (b[i] == b'b' && b.get(i + 1) == Some(&b'r')))
            && (i == 0 || !ident(b[i - 1]))
        {
            let start = if b[i] == b'b' { i + 2 } else { i + 1 };
            let hashes = b[start..].iter().take_while(|&&c| c == b'#').count();
            if b.get(start + hashes) == Some(&b'"') {
                let end = format!("\"{}", "#".repeat(hashes));
                let body = start + hashes + 1;
                i = src[body..]
                    .find(&end)
                    .map_or(b.len(), |j| body + j + end.len());
                out.push_str("\"\"");
                continue;
            }
        }
        if b[i] == b'"' {
            let mut j = i + 1;
            while j < b.len() && b[j] != b'"' {
                j += if b[j] == b'\\' { 2 } else { 1 };
            }
            i = j + 1;
            out.push_str("\"\"");
            continue;
        }
        if b[i] == b'\'' {
            // A char literal ('x', '\n', '\u{1F600}'); otherwise a lifetime.
            let len = if b.get(i + 1) == Some(&b'\\') {
                b[i + 2..].iter().position(|&c| c == b'\'').map(|p| p + 3)
            } else {
                let ch = src[i + 1..].chars().next().map_or(1, char::len_utf8);
                (b.get(i + 1 + ch) == Some(&b'\'')).then_some(ch + 2)
            };
            if let Some(len) = len {
                i += len;
                out.push_str("' '");
                continue;
            }
        }
        let ch = src[i..].chars().next().unwrap();
        out.push(ch);
        i += ch.len_utf8();
    }
    out
}

/// `a::{b, c::{d as f, e}}` -> `a::b`, `a::c::d`, `a::c::e` (renames and whitespace removed).
fn expand(tree: &str) -> Vec<String> {
    let mut words = tree.split_whitespace();
    let mut flat = String::new();
    while let Some(w) = words.next() {
        if w == "as" {
            let alias = words.next().unwrap_or("");
            flat.push_str(alias.trim_start_matches(|c: char| c.is_alphanumeric() || c == '_'));
        } else {
            flat.push_str(w);
        }
    }
    expand_flat(&flat)
}

fn expand_flat(tree: &str) -> Vec<String> {
    let tree = tree.to_string();
    let Some(open) = tree.find('{') else {
        return vec![tree];
    };
    let (prefix, body) = (
        &tree[..open],
        &tree[open + 1..tree.rfind('}').unwrap_or(tree.len())],
    );
    let mut parts = Vec::new();
    let (mut depth, mut start) = (0, 0);
    for (k, c) in body.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&body[start..k]);
                start = k + 1;
            }
            _ => {}
        }
    }
    parts.push(&body[start..]);
    parts
        .into_iter()
        .filter(|p| !p.is_empty())
        .flat_map(|p| {
            expand_flat(p)
                .into_iter()
                .map(move |e| format!("{prefix}{e}"))
        })
        .collect()
}

/// The paths a module's source names, relative ones (`crate`, `super`, `self`) resolved to
/// the longest prefix that is a module of `known`.
fn references(module: &ModPath, source: &str, known: &BTreeSet<ModPath>) -> BTreeSet<ModPath> {
    let s = strip(source);
    let mut paths = Vec::new();
    let mut rest = s.as_str();
    while let Some(k) = rest.find("use ") {
        let before = rest[..k].chars().next_back();
        rest = &rest[k + 4..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue;
        }
        if let Some(end) = rest.find(';') {
            paths.extend(expand(&rest[..end]));
        }
    }
    let b = s.as_bytes();
    for word in ["crate::", "super::", "self::"] {
        let mut from = 0;
        while let Some(k) = s[from..].find(word) {
            let at = from + k;
            from = at + word.len();
            if at > 0
                && (b[at - 1].is_ascii_alphanumeric() || b[at - 1] == b'_' || b[at - 1] == b'$')
            {
                continue;
            }
            let len = s[at..]
                .find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':'))
                .unwrap_or(s.len() - at);
            paths.push(s[at..at + len].to_string());
        }
    }
    let mut out = BTreeSet::new();
    for p in paths {
        let mut segs = p.split("::").filter(|s| !s.is_empty()).peekable();
        let mut base = match segs.peek() {
            Some(&"crate") => {
                segs.next();
                Vec::new()
            }
            Some(&"super") | Some(&"self") => module.clone(),
            _ => continue,
        };
        while let Some(&s) = segs.peek() {
            match s {
                "super" => base.truncate(base.len().saturating_sub(1)),
                "self" => {}
                _ => break,
            }
            segs.next();
        }
        let mut cur = base.clone();
        let mut best = base;
        for seg in segs {
            cur.push(seg.to_string());
            if !known.contains(&cur) {
                break;
            }
            best = cur.clone();
        }
        // The crate root (`crate::{..}` before expansion, `super::` from a top-level module) is
        // every module's ancestor: never an edge.
        if !best.is_empty() {
            out.insert(best);
        }
    }
    out
}

/// Every `.rs` file under `src` as its module path.
fn modules(src: &Path) -> BTreeMap<ModPath, PathBuf> {
    let mut out = BTreeMap::new();
    let mut dirs = vec![src.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let rel = path.strip_prefix(src).unwrap().with_extension("");
            let mut m: ModPath = rel
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            if m.last().is_some_and(|l| l == "mod") || m == ["lib"] || m == ["main"] {
                m.pop();
            }
            out.insert(m, path);
        }
    }
    out
}

/// parent module -> (child -> children it uses, with one file that does).
type Edges = BTreeMap<ModPath, BTreeMap<String, BTreeMap<String, PathBuf>>>;

fn edges(files: &BTreeMap<ModPath, PathBuf>, sources: &dyn Fn(&Path) -> String) -> Edges {
    let known: BTreeSet<ModPath> = files.keys().cloned().collect();
    let mut out = Edges::new();
    for (m, path) in files {
        for r in references(m, &sources(path), &known) {
            let common = m.iter().zip(&r).take_while(|(a, b)| a == b).count();
            if common == m.len() || common == r.len() {
                continue;
            }
            out.entry(m[..common].to_vec())
                .or_default()
                .entry(m[common].clone())
                .or_default()
                .entry(r[common].clone())
                .or_insert_with(|| path.clone());
        }
    }
    out
}

/// The strongly connected components of more than one node (Tarjan).
fn cycles(g: &BTreeMap<String, BTreeMap<String, PathBuf>>) -> Vec<BTreeSet<String>> {
    struct T<'a> {
        g: &'a BTreeMap<String, BTreeMap<String, PathBuf>>,
        index: BTreeMap<&'a str, (usize, usize)>,
        stack: Vec<&'a str>,
        on: BTreeSet<&'a str>,
        out: Vec<BTreeSet<String>>,
    }
    fn visit<'a>(t: &mut T<'a>, v: &'a str) {
        let n = t.index.len();
        t.index.insert(v, (n, n));
        t.stack.push(v);
        t.on.insert(v);
        for w in t.g.get(v).into_iter().flat_map(|m| m.keys()) {
            let w = w.as_str();
            if !t.index.contains_key(w) {
                visit(t, w);
                let low = t.index[v].1.min(t.index[w].1);
                t.index.get_mut(v).unwrap().1 = low;
            } else if t.on.contains(w) {
                let low = t.index[v].1.min(t.index[w].0);
                t.index.get_mut(v).unwrap().1 = low;
            }
        }
        if t.index[v].0 == t.index[v].1 {
            let mut comp = BTreeSet::new();
            loop {
                let w = t.stack.pop().unwrap();
                t.on.remove(w);
                comp.insert(w.to_string());
                if w == v {
                    break;
                }
            }
            if comp.len() > 1 {
                t.out.push(comp);
            }
        }
    }
    let mut t = T {
        g,
        index: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in g.keys() {
        if !t.index.contains_key(v.as_str()) {
            visit(&mut t, v);
        }
    }
    t.out
}

fn crate_sources(root: &Path) -> Vec<(String, PathBuf)> {
    let mut out = vec![("src".to_string(), root.join("src"))];
    let mut members: Vec<_> = std::fs::read_dir(root.join("crates"))
        .into_iter()
        .flatten()
        .map(|e| e.unwrap().path().join("src"))
        .filter(|p| p.is_dir())
        .collect();
    members.sort();
    for m in members {
        let name = m.strip_prefix(root).unwrap().to_string_lossy().into_owned();
        out.push((name, m));
    }
    out
}

#[test]
fn no_import_cycles_between_modules() {
    // KVLB_CYCLES_ROOT: check another checkout (e.g. one extracted with `git archive`).
    let root = std::env::var_os("KVLB_CYCLES_ROOT")
        .map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from);
    let root = root.as_path();
    let read = |p: &Path| std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{p:?}: {e}"));
    let mut problems = Vec::new();
    let mut known_seen = vec![false; KNOWN_CYCLES.len()];
    for (name, src) in crate_sources(root) {
        let files = modules(&src);
        assert!(!files.is_empty(), "{name}: no module files");
        for (parent, g) in edges(&files, &read) {
            let parent_name = parent.join("::");
            for comp in cycles(&g) {
                let known = KNOWN_CYCLES.iter().position(|(c, p, mods)| {
                    *c == name
                        && *p == parent_name
                        && comp.iter().all(|m| mods.contains(&m.as_str()))
                });
                if let Some(k) = known {
                    known_seen[k] = true;
                    continue;
                }
                let mut text = format!(
                    "{name}: import cycle among the modules of `{}`: {}\n",
                    if parent_name.is_empty() {
                        "crate"
                    } else {
                        &parent_name
                    },
                    comp.iter().cloned().collect::<Vec<_>>().join(", ")
                );
                for a in &comp {
                    for (b, file) in &g[a] {
                        if comp.contains(b) {
                            let file = file.strip_prefix(root).unwrap_or(file);
                            text += &format!("    {a} -> {b}   (e.g. {})\n", file.display());
                        }
                    }
                }
                problems.push(text);
            }
        }
    }
    for (k, seen) in known_seen.iter().enumerate() {
        if !seen {
            let (c, p, mods) = KNOWN_CYCLES[k];
            problems.push(format!(
                "KNOWN_CYCLES lists {c} `{p}`: {mods:?}, which is no longer a cycle: remove it\n"
            ));
        }
    }
    assert!(problems.is_empty(), "\n{}", problems.concat());
}

#[test]
fn the_checker_reads_paths_and_finds_cycles() {
    let src = r#"
        //! Uses crate::c in a doc comment only.
        use crate::{a::{x, y as z}, b};
        pub(crate) use crate::a::x::{self as w};
        use super::sibling::Thing;
        fn f() -> &'static str { let c = '"'; let _ = crate::d::g(); "crate::e" }
        /* crate::f */
    "#;
    let known: BTreeSet<ModPath> = [
        vec![],
        vec!["a".into()],
        vec!["a".into(), "x".into()],
        vec!["b".into()],
        vec!["c".into()],
        vec!["d".into()],
        vec!["e".into()],
        vec!["f".into()],
        vec!["m".into()],
        vec!["m".into(), "here".into()],
        vec!["m".into(), "sibling".into()],
    ]
    .into_iter()
    .collect();
    let here = vec!["m".to_string(), "here".to_string()];
    let got: Vec<String> = references(&here, src, &known)
        .into_iter()
        .map(|p| p.join("::"))
        .collect();
    assert_eq!(got, ["a", "a::x", "b", "d", "m::sibling"]);

    let files: BTreeMap<ModPath, PathBuf> = [
        (vec!["p".into()], "p.rs"),
        (vec!["q".into()], "q.rs"),
        (vec!["q".into(), "inner".into()], "q/inner.rs"),
        (vec!["r".into()], "r.rs"),
    ]
    .into_iter()
    .map(|(m, f)| (m, PathBuf::from(f)))
    .collect();
    let sources = |p: &Path| match p.to_str().unwrap() {
        "p.rs" => "use crate::q::inner::X;".to_string(),
        "q/inner.rs" => "use crate::p::Y; use super::Z;".to_string(),
        "r.rs" => "use crate::p::Y;".to_string(),
        _ => String::new(),
    };
    let e = edges(&files, &sources);
    let found = cycles(&e[&Vec::new()]);
    assert_eq!(
        found,
        [["p".to_string(), "q".to_string()].into_iter().collect()]
    );
}
