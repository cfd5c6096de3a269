//! The module graph of `exs/src` has no circle (issue 28), and the manual's drawing of it (`manual/inside.md`)
//! names every module. Read from the sources: each file is a node, and a file that names
//! `crate::a::b` (or a root re-export such as `crate::Socket`) depends on the file that defines it. A child
//! module's own `super::` is not an edge (the parent declares the child; that is nesting, not a dependency).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// Every `.rs` file under `exs/src`, by its module path ("engine", "engine/calls", "lib").
fn files() -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut dirs = vec![src()];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                let rel = p.strip_prefix(src()).unwrap().with_extension("");
                let mut name = rel.to_string_lossy().into_owned();
                if let Some(parent) = name.strip_suffix("/mod") {
                    name = parent.to_string();
                }
                out.insert(name, std::fs::read_to_string(&p).unwrap());
            }
        }
    }
    out
}

/// The code of a file without its comments (line comments; doc comments are line comments too).
fn code(text: &str) -> String {
    text.lines()
        .map(|l| match l.find("//") {
            Some(i) if !l[..i].contains('"') => &l[..i],
            _ => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The module paths a file names after `crate::`, as far as they go (`crate::proto::conn::Conn` gives
/// `["proto", "conn", "Conn"]`).
fn crate_paths(code: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    for (i, _) in code.match_indices("crate::") {
        if code[..i].ends_with(|c: char| c.is_alphanumeric() || c == '_') {
            continue; // `exs_crate::`, not ours
        }
        let rest = &code[i + "crate::".len()..];
        let mut path = Vec::new();
        for seg in rest.split("::") {
            let ident: String = seg
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            if ident.is_empty() {
                break;
            }
            let whole = ident.len() == seg.len();
            path.push(ident);
            if !whole {
                break;
            }
        }
        out.push(path);
    }
    out
}

/// The root's re-exports: `pub use module::{A, B}` gives A -> module.
fn reexports(lib: &str) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let code = code(lib);
    for stmt in code.split(';') {
        let Some(body) = stmt.trim().strip_prefix("pub use ") else {
            continue;
        };
        let Some((module, names)) = body.split_once("::") else {
            continue;
        };
        for name in names.split(|c: char| "{}, \n".contains(c)) {
            if !name.is_empty() {
                out.insert(name.to_string(), module.trim().to_string());
            }
        }
    }
    out
}

/// The file a path names: the longest prefix of it that is a file, through the root's re-exports.
fn resolve(
    path: &[String],
    files: &BTreeMap<String, String>,
    roots: &BTreeMap<String, String>,
) -> Option<String> {
    let first = path.first()?;
    let mut segs: Vec<String> = match roots.get(first) {
        Some(m) if !files.contains_key(first) => vec![m.clone()],
        _ => path.to_vec(),
    };
    while !segs.is_empty() {
        let name = segs.join("/");
        if files.contains_key(&name) {
            return Some(name);
        }
        segs.pop();
    }
    None
}

fn graph() -> BTreeMap<String, BTreeSet<String>> {
    let files = files();
    let roots = reexports(&files["lib"]);
    let mut g = BTreeMap::new();
    for (name, text) in &files {
        let mut deps = BTreeSet::new();
        for path in crate_paths(&code(text)) {
            if let Some(to) = resolve(&path, &files, &roots) {
                let nested =
                    to.starts_with(&format!("{name}/")) || name.starts_with(&format!("{to}/"));
                if to != *name && to != "lib" && !nested {
                    deps.insert(to);
                }
            }
        }
        g.insert(name.clone(), deps);
    }
    g
}

/// A circle through `at`, if one is reachable from it.
fn circle(
    g: &BTreeMap<String, BTreeSet<String>>,
    at: &str,
    stack: &mut Vec<String>,
    done: &mut BTreeSet<String>,
) -> Option<Vec<String>> {
    if let Some(i) = stack.iter().position(|s| s == at) {
        let mut c = stack[i..].to_vec();
        c.push(at.to_string());
        return Some(c);
    }
    if done.contains(at) {
        return None;
    }
    stack.push(at.to_string());
    for next in g.get(at).into_iter().flatten() {
        if let Some(c) = circle(g, next, stack, done) {
            return Some(c);
        }
    }
    stack.pop();
    done.insert(at.to_string());
    None
}

#[test]
fn the_module_graph_of_exs_has_no_circle() {
    let g = graph();
    assert!(g.len() > 40, "the sources were read: {} files", g.len());
    assert!(
        g["engine"].contains("event") && g["socket"].contains("context"),
        "the graph has the edges it must: {g:?}"
    );
    let mut done = BTreeSet::new();
    for node in g.keys() {
        if let Some(c) = circle(&g, node, &mut Vec::new(), &mut done) {
            panic!("a circle in exs/src: {}", c.join(" -> "));
        }
    }
}

#[test]
fn the_engine_names_no_public_type_above_it() {
    let g = graph();
    for above in [
        "context",
        "socket",
        "memory",
        "stream_io",
        "tokio",
        "sendfile",
    ] {
        for (file, deps) in g.iter().filter(|(f, _)| f.starts_with("engine")) {
            assert!(!deps.contains(above), "{file} depends on {above}");
        }
    }
}

/// The drawing in the manual names every module of the crate (a new one must find its layer there).
#[test]
fn the_manuals_drawing_names_every_module() {
    let drawing = std::fs::read_to_string(src().join("manual/inside.md")).unwrap();
    let mut missing = BTreeSet::new();
    for name in graph().keys() {
        let top = name.split('/').next().unwrap();
        if ["lib", "manual"].contains(&top) {
            continue;
        }
        let shown = [format!("{top}/"), format!("{top}.rs")]
            .iter()
            .any(|n| drawing.contains(n.as_str()));
        if !shown {
            missing.insert(top.to_string());
        }
    }
    assert!(
        missing.is_empty(),
        "manual/inside.md does not show {missing:?}"
    );
}
