//! Redis key layout: `<prefix>{<scope>}:<key>`. The hash tag `{<scope>}`
//! puts every key of a scope in one Redis Cluster slot.

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

    /// The Redis key of `key` in `scope`. Braces in the scope would break
    /// the hash tag, so they are escaped (`{` as `%7B`, `}` as `%7D`, `%` as
    /// `%25`).
    pub(crate) fn key(&self, scope: &str, key: &str) -> String {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_hash_tag_per_scope() {
        let k = KeyLayout::new("onceonly:");
        assert_eq!(k.key("sms", "u-1"), "onceonly:{sms}:u-1");
        assert_eq!(k.key("a{b}%", "x"), "onceonly:{a%7Bb%7D%25}:x");
    }
}
