//! Redis key layout: `<prefix><scope>:<key>`, with no hash tag, so that a
//! Redis Cluster hashes the whole key and the keys of one scope spread
//! over every slot. Every script touches one key, so none needs two keys in
//! one slot.
//!
//! The scope has `%`, `{`, `}` and `:` escaped (`%25`, `%7B`, `%7D`,
//! `%3A`), the key `%`, `{` and `}`: no brace of a scope or key can make a
//! hash tag (which would pin its keys to one slot again), and the first
//! `:` after the prefix always ends the scope (scope `a:b` with key `c` and
//! scope `a` with key `b:c` stay two keys). A brace in the prefix is the
//! user's: a prefix with a hash tag (`{pay}:`) pins every key to one slot,
//! on purpose.

/// Builds Redis keys for one prefix.
#[derive(Clone, Debug)]
pub(crate) struct KeyLayout {
    prefix: String,
}

impl KeyLayout {
    pub(crate) fn new(prefix: impl Into<String>) -> Self {
        Self {
            prefix: prefix.into(),
        }
    }

    /// The Redis key of `key` in `scope`.
    pub(crate) fn key(&self, scope: &str, key: &str) -> String {
        let mut out = String::with_capacity(self.prefix.len() + scope.len() + key.len() + 1);
        out.push_str(&self.prefix);
        escape(&mut out, scope, true);
        out.push(':');
        escape(&mut out, key, false);
        out
    }

    /// The key of the earlier layout (before keys spread over slots),
    /// `<prefix>{<scope>}:<key>` (scope escaped as `%25`, `%7B`, `%7D`, the
    /// key as it is): read during an upgrade, never written.
    pub(crate) fn scope_tagged_key(&self, scope: &str, key: &str) -> String {
        let mut tag = String::with_capacity(scope.len());
        for c in scope.chars() {
            match c {
                '%' => tag.push_str("%25"),
                '{' => tag.push_str("%7B"),
                '}' => tag.push_str("%7D"),
                c => tag.push(c),
            }
        }
        format!("{}{{{tag}}}:{key}", self.prefix)
    }
}

fn escape(out: &mut String, part: &str, colon: bool) {
    for c in part.chars() {
        match c {
            '%' => out.push_str("%25"),
            '{' => out.push_str("%7B"),
            '}' => out.push_str("%7D"),
            ':' if colon => out.push_str("%3A"),
            c => out.push(c),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_hash_tag_and_no_ambiguity() {
        let k = KeyLayout::new("onceonly:");
        assert_eq!(k.key("sms", "u-1"), "onceonly:sms:u-1");
        assert_eq!(k.key("a{b}%", "x"), "onceonly:a%7Bb%7D%25:x");
        assert_eq!(k.key("s", "{tag}:50%"), "onceonly:s:%7Btag%7D:50%25");
        // The first `:` after the prefix ends the scope.
        assert_ne!(k.key("a:b", "c"), k.key("a", "b:c"));
        assert_eq!(k.key("a:b", "c"), "onceonly:a%3Ab:c");
        // No brace from a scope or key ever reaches Redis.
        for (scope, key) in [("{x}", "{y}"), ("}{", "}{}"), ("%7B", "{")] {
            let r = k.key(scope, key);
            assert!(!r.contains(['{', '}']), "{r}");
        }
    }

    #[test]
    fn the_scope_tagged_layout_of_before() {
        let k = KeyLayout::new("onceonly:");
        assert_eq!(k.scope_tagged_key("sms", "u-1"), "onceonly:{sms}:u-1");
        assert_eq!(k.scope_tagged_key("a{b}%", "x"), "onceonly:{a%7Bb%7D%25}:x");
    }
}
