//! Copies the snippets of README.md and docs/*.md that tests run as
//! written into `$OUT_DIR/snippets/<name>.rs`, for `include!`.
//!
//! A snippet is the first ```` ```rust ```` block after a line
//! `<!-- snippet: <name> ... -->`. Its lines are kept as written; the
//! lines rustdoc hides (`# ...`) are kept without their `# `, except the
//! `#[cfg(...)]` that gates a doctest on the library's features (the
//! tests' crate has those features on, and no such names).

use std::path::{Path, PathBuf};
use std::{env, fs};

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR")).join("snippets");
    fs::create_dir_all(&out).expect("create $OUT_DIR/snippets");
    let mut sources = vec![root.join("README.md")];
    let mut docs: Vec<PathBuf> = fs::read_dir(root.join("docs"))
        .expect("read docs/")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    docs.sort();
    sources.extend(docs);
    println!("cargo:rerun-if-changed={}", root.join("docs").display());
    for source in sources {
        println!("cargo:rerun-if-changed={}", source.display());
        let text = fs::read_to_string(&source).expect("read a markdown file");
        for (name, code) in snippets(&text, &source) {
            fs::write(out.join(format!("{name}.rs")), code).expect("write a snippet");
        }
    }
}

/// The named snippets of one markdown file.
fn snippets(text: &str, source: &Path) -> Vec<(String, String)> {
    let mut found = Vec::new();
    let mut lines = text.lines();
    while let Some(line) = lines.next() {
        let Some(rest) = line.trim().strip_prefix("<!-- snippet:") else {
            continue;
        };
        let name: String = rest
            .trim()
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        assert!(
            !name.is_empty(),
            "{}: a snippet marker without a name",
            source.display()
        );
        let opening = lines.next().unwrap_or_default();
        assert!(
            opening.starts_with("```rust"),
            "{}: snippet {name} is not followed by a ```rust block",
            source.display()
        );
        let mut code = String::new();
        for line in lines.by_ref() {
            if line.starts_with("```") {
                break;
            }
            let shown = match line.strip_prefix("# ") {
                Some(hidden) if hidden.trim_start().starts_with("#[cfg(") => continue,
                Some(hidden) => hidden,
                None if line == "#" => "",
                None => line,
            };
            code.push_str(shown);
            code.push('\n');
        }
        found.push((name, code));
    }
    found
}
