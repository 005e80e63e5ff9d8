//! Prefix affinity: which node last got a request starting with the same prompt prefix, so
//! that requests sharing a prefix (a system prompt, a conversation's earlier turns) go where
//! that prefix is cached. An approximation of the nodes' prefix caches, as SGLang's router
//! keeps one: the prompt's text is cut into blocks, each block named by a hash of everything
//! up to its end, and each name remembers the node it was last sent to.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};

/// Characters of prompt text per block: shorter prefixes are not worth a detour.
pub const BLOCK_BYTES: usize = 64;

/// Block names remembered; past it the older half is forgotten.
const CAPACITY: usize = 1 << 16;

/// Block name → (node, when it was last sent there).
#[derive(Default)]
pub struct Affinity {
    blocks: HashMap<u64, (String, u64)>,
    clock: u64,
    hasher: rustc_hash::FxBuildHasher,
}

impl Affinity {
    /// The names of the whole blocks of `text`, each covering everything before it.
    fn names(&self, text: &[u8]) -> Vec<u64> {
        let mut hasher = self.hasher.build_hasher();
        text.chunks_exact(BLOCK_BYTES)
            .map(|block| {
                hasher.write(block);
                hasher.finish()
            })
            .collect()
    }

    /// The node that got the longest prefix of `text` of the nodes `usable` accepts, and
    /// how many blocks long that prefix is.
    pub fn best(&self, text: &[u8], usable: impl Fn(&str) -> bool) -> Option<(String, usize)> {
        let names = self.names(text);
        names.iter().enumerate().rev().find_map(|(i, name)| {
            let (node, _) = self.blocks.get(name)?;
            usable(node).then(|| (node.clone(), i + 1))
        })
    }

    /// `text` was sent to `node`.
    pub fn sent(&mut self, text: &[u8], node: &str) {
        self.clock += 1;
        for name in self.names(text) {
            self.blocks.insert(name, (node.to_string(), self.clock));
        }
        if self.blocks.len() > CAPACITY {
            let mut stamps: Vec<u64> = self.blocks.values().map(|(_, t)| *t).collect();
            let (_, &mut median, _) = stamps.select_nth_unstable(CAPACITY / 2);
            self.blocks.retain(|_, (_, t)| *t > median);
        }
    }

    /// Blocks remembered.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_longest_shared_prefix_wins_among_usable_nodes() {
        let mut affinity = Affinity::default();
        let system = "s".repeat(3 * BLOCK_BYTES);
        affinity.sent(format!("{system}{}", "a".repeat(200)).as_bytes(), "node1");
        affinity.sent(&system.as_bytes()[..2 * BLOCK_BYTES], "node2");
        let asked = format!("{system}{}", "b".repeat(100));
        // Three blocks in common with node1's request, two with node2's.
        assert_eq!(
            affinity.best(asked.as_bytes(), |_| true),
            Some(("node1".into(), 3))
        );
        // The second block was sent to node2 last.
        assert_eq!(
            affinity.best(asked.as_bytes(), |n| n != "node1"),
            Some(("node2".into(), 2))
        );
        assert_eq!(affinity.best(b"short", |_| true), None);
        assert_eq!(affinity.best("x".repeat(200).as_bytes(), |_| true), None);
    }

    #[test]
    fn it_forgets_the_older_half_when_full() {
        let mut affinity = Affinity::default();
        for i in 0..=CAPACITY {
            affinity.sent(format!("{i:0width$}", width = BLOCK_BYTES).as_bytes(), "n");
        }
        assert!(affinity.len() <= CAPACITY / 2 + 1, "{}", affinity.len());
        let newest = format!("{CAPACITY:0width$}", width = BLOCK_BYTES);
        assert!(affinity.best(newest.as_bytes(), |_| true).is_some());
        assert!(
            affinity
                .best(format!("{:0w$}", 0, w = BLOCK_BYTES).as_bytes(), |_| true)
                .is_none()
        );
    }
}
