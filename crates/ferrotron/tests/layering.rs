//! The layers of every crate, as `docs/DESIGN.md` states them, checked on the source: no file
//! imports a file that (through others) imports it back, and no module imports one above it.
//!
//! An import is a `crate::…` or `super::…` path anywhere in a file's non-test code (a `use` or a
//! path in an expression), resolved to the file that defines the longest prefix of it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Each crate's top-level modules, lowest first: a module may import only itself and those before
/// it. (`lib`/`main` is the crate root, above everything.)
const LAYERS: &[(&str, &[&str])] = &[
    (
        "ferrotron-core",
        &[
            "bounded",
            "error",
            "text_value",
            "precision",
            "model",
            "topology",
            "rank",
            "layout",
            "schedule",
            "plan",
        ],
    ),
    (
        "ferrotron-engine",
        &[
            "memory",
            "kernels",
            "comm",
            "error",
            "paths",
            "storage",
            "dir_lock",
            "pieces",
            "transformer",
            "half_storage",
            "optim",
            "parallel",
            "hf",
            "lora",
            "model_source",
            "data",
            "checkpoint",
            "runtime",
        ],
    ),
    (
        "ferrotron",
        &["report", "machine", "profiling", "supervisor", "cmd"],
    ),
];

type Module = Vec<String>;

/// Every source file of a crate by its module path (`kernels/cpu/mod.rs` is `kernels::cpu`), with
/// its text up to its unit tests. Binaries under `src/bin/` are crates of their own: skipped.
fn modules(src: &Path) -> BTreeMap<Module, String> {
    let mut out = BTreeMap::new();
    let mut stack = vec![src.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                if p.file_name().unwrap() != "bin" || dir != src {
                    stack.push(p);
                }
                continue;
            }
            if p.extension().is_none_or(|x| x != "rs") {
                continue;
            }
            let rel = p.strip_prefix(src).unwrap().with_extension("");
            let mut m: Module = rel
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            if m.last()
                .is_some_and(|l| l == "mod" || l == "lib" || l == "main")
            {
                m.pop();
            }
            let text = std::fs::read_to_string(&p).unwrap();
            let text = match text.find("#[cfg(test)]") {
                Some(i) => text[..i].to_string(),
                None => text,
            };
            out.insert(m, text);
        }
    }
    out
}

/// The paths a file names through `crate::` or `super::`, each as the module path it starts from
/// plus its segments; `use a::{b, c::d}` groups are expanded.
fn imported_paths(module: &Module, text: &str) -> Vec<Module> {
    let code: String = text
        .lines()
        .map(|l| match l.find("//") {
            Some(i) => &l[..i],
            None => l,
        })
        .collect::<Vec<_>>()
        .join("\n");
    let mut out = Vec::new();
    let bytes = code.as_bytes();
    let word = |c: u8| c.is_ascii_alphanumeric() || c == b'_';
    let mut i = 0;
    while i < bytes.len() {
        if !code.is_char_boundary(i) {
            i += 1;
            continue;
        }
        let start_ok = i == 0 || !word(bytes[i - 1]);
        let rest = &code[i..];
        let (base, skip) = if start_ok && rest.starts_with("crate::") {
            (Vec::new(), "crate::".len())
        } else if start_ok && rest.starts_with("super::") {
            // `super` is the module path less its last segment, for `a/b.rs` and `a/b/mod.rs`
            // alike; each further `super::` climbs one more.
            let mut base = module.clone();
            let mut n = 0;
            let mut r = rest;
            while let Some(t) = r.strip_prefix("super::") {
                n += 1;
                r = t;
            }
            for _ in 0..n {
                base.pop();
            }
            (base, rest.len() - r.len())
        } else {
            i += 1;
            continue;
        };
        i += skip;
        for tail in path_tails(&code[i..]) {
            let mut p = base.clone();
            p.extend(tail);
            out.push(p);
        }
    }
    out
}

/// The segment lists a path continues with: `a::b::C` gives one; `a::{b, c::d}` gives several.
fn path_tails(s: &str) -> Vec<Vec<String>> {
    let mut segs = Vec::new();
    let mut rest = s;
    loop {
        let ident: String = rest
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        if !ident.is_empty() {
            segs.push(ident.clone());
            rest = &rest[ident.len()..];
            if let Some(r) = rest.strip_prefix("::") {
                rest = r;
                continue;
            }
            return vec![segs];
        }
        if rest.starts_with('{') {
            let mut depth = 0;
            let mut end = 0;
            for (k, c) in rest.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' => {
                        depth -= 1;
                        if depth == 0 {
                            end = k;
                            break;
                        }
                    }
                    _ => {}
                }
            }
            let inner = &rest[1..end];
            let mut out = Vec::new();
            let mut depth = 0;
            let mut from = 0;
            let mut items = Vec::new();
            for (k, c) in inner.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        items.push(&inner[from..k]);
                        from = k + 1;
                    }
                    _ => {}
                }
            }
            items.push(&inner[from..]);
            for item in items {
                for t in path_tails(item.trim()) {
                    let mut p = segs.clone();
                    p.extend(t);
                    out.push(p);
                }
            }
            if out.is_empty() {
                out.push(segs);
            }
            return out;
        }
        return vec![segs];
    }
}

/// File-level imports: for every module, the other modules (files) its paths land in.
fn edges(mods: &BTreeMap<Module, String>) -> BTreeMap<Module, BTreeSet<Module>> {
    let mut out: BTreeMap<Module, BTreeSet<Module>> = BTreeMap::new();
    for (m, text) in mods {
        for p in imported_paths(m, text) {
            let target = (0..=p.len())
                .rev()
                .map(|k| p[..k].to_vec())
                .find(|prefix| mods.contains_key(prefix));
            if let Some(t) = target {
                if &t != m && !t.is_empty() {
                    out.entry(m.clone()).or_default().insert(t);
                }
            }
        }
    }
    out
}

/// The circles of a graph, one per back edge a depth-first search meets.
fn cycles(graph: &BTreeMap<Module, BTreeSet<Module>>) -> Vec<Vec<Module>> {
    #[derive(Clone, Copy, PartialEq)]
    enum Mark {
        Open,
        Done,
    }
    fn visit(
        v: &Module,
        g: &BTreeMap<Module, BTreeSet<Module>>,
        marks: &mut BTreeMap<Module, Mark>,
        path: &mut Vec<Module>,
        found: &mut Vec<Vec<Module>>,
    ) {
        marks.insert(v.clone(), Mark::Open);
        path.push(v.clone());
        for w in g.get(v).into_iter().flatten() {
            match marks.get(w) {
                Some(Mark::Open) => {
                    let at = path.iter().position(|x| x == w).unwrap();
                    found.push(path[at..].to_vec());
                }
                Some(Mark::Done) => {}
                None => visit(w, g, marks, path, found),
            }
        }
        path.pop();
        marks.insert(v.clone(), Mark::Done);
    }
    let mut marks = BTreeMap::new();
    let mut found = Vec::new();
    for v in graph.keys() {
        if !marks.contains_key(v) {
            visit(v, graph, &mut marks, &mut Vec::new(), &mut found);
        }
    }
    found
}

fn crate_src(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(name)
        .join("src")
}

fn show(m: &Module) -> String {
    m.join("::")
}

#[test]
fn no_file_imports_one_that_imports_it_back() {
    let mut problems = Vec::new();
    for (name, _) in LAYERS {
        let src = crate_src(name);
        let mods = modules(&src);
        for c in cycles(&edges(&mods)) {
            problems.push(format!(
                "{name}: {}",
                c.iter().map(show).collect::<Vec<_>>().join(" → ")
            ));
        }
    }
    assert!(
        problems.is_empty(),
        "import circles:\n{}",
        problems.join("\n")
    );
}

#[test]
fn no_module_imports_one_above_it() {
    let mut problems = Vec::new();
    for (name, order) in LAYERS {
        let src = crate_src(name);
        let mods = modules(&src);
        for m in mods.keys().filter(|m| !m.is_empty()) {
            assert!(
                order.contains(&m[0].as_str()),
                "{name}: the module `{}` has no place in the layer order of \
                 crates/ferrotron/tests/layering.rs (and docs/DESIGN.md): give it one",
                m[0]
            );
        }
        let level = |m: &Module| order.iter().position(|o| *o == m[0]).unwrap();
        for (from, tos) in edges(&mods) {
            if from.is_empty() {
                continue;
            }
            for to in tos.iter().filter(|t| level(t) > level(&from)) {
                problems.push(format!(
                    "{name}: {} imports {}, which is above it",
                    show(&from),
                    show(to)
                ));
            }
        }
    }
    assert!(
        problems.is_empty(),
        "upward imports:\n{}",
        problems.join("\n")
    );
}

#[test]
fn the_checker_sees_circles_and_upward_imports() {
    // The checker itself, on a made-up crate: a circle through a `use` group and a `super` path.
    let m = |s: &str| -> Module { s.split("::").map(String::from).collect() };
    let paths = imported_paths(
        &m("kernels::cpu"),
        "use crate::kernels::{float::Real, simd};\nfn f() { super::Backend::x(); }\n",
    );
    assert!(paths.contains(&m("kernels::float::Real")), "{paths:?}");
    assert!(paths.contains(&m("kernels::simd")), "{paths:?}");
    assert!(paths.contains(&m("kernels::Backend::x")), "{paths:?}");
    let mut g = BTreeMap::new();
    g.insert(m("a"), BTreeSet::from([m("b")]));
    g.insert(m("b"), BTreeSet::from([m("c")]));
    g.insert(m("c"), BTreeSet::from([m("a")]));
    assert_eq!(cycles(&g).len(), 1);
}
