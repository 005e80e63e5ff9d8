//! Prompt prefixes kept for reuse: when a prompt has been prefilled, a copy of its KV cache
//! (whole blocks of it) is kept, and a later prompt that starts with the same blocks of
//! tokens (a shared system prompt, a conversation's earlier turns, a sequence preempted and
//! recomputing) starts from a copy of it and prefills only the rest. In host memory the
//! caches are copies, so reuse saves compute and time to first token, not memory; on a GPU a
//! copy shares its source's whole blocks, and every cache holding a block counts its share
//! of it ([`KvCache::shared_blocks`]), so a shared block counts once against the budget. The
//! kept copies count against the KV budget and are dropped, oldest first, before any running
//! sequence is preempted.
//!
//! A hybrid model's cache (Qwen3-Next) also holds linear layers' states, each the summary of
//! every position so far: it cannot be cut back to a shorter prefix. Such a cache is kept
//! whole (every position the prompt's prefill left, not whole blocks) and reused only by a
//! prompt that starts with all of it: the exact end of a cached prefix, where the state is
//! the one the new prompt needs. A preempted sequence recomputing, a conversation's next turn
//! and a repeated system prompt followed by more all start that way; two prompts that share
//! only part of a kept prefix reuse nothing (snapshots of the states at block boundaries, as
//! vLLM and SGLang keep, would serve them, at a state's size per snapshot).

use super::EngineError;
use super::kv_cache::KvCache;

/// A key for the first block of `tokens` (`block_tokens` of them); `None` when shorter. Two
/// prompts with the same key very likely start alike; the store checks the tokens.
pub fn leading_block_key(tokens: &[u32], block_tokens: usize) -> Option<u64> {
    use std::hash::{Hash, Hasher};
    let block = tokens.get(..block_tokens.max(1))?;
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    block.hash(&mut hasher);
    Some(hasher.finish())
}

struct Entry {
    /// The prefix, a whole number of blocks.
    tokens: Vec<u32>,
    /// Its cache, holding exactly `tokens.len()` positions.
    cache: KvCache,
}

pub struct PrefixStore {
    block_tokens: usize,
    max_entries: usize,
    /// Blocks a kept cache's linear states count for (see `KvBudget::state_blocks`).
    state_blocks: usize,
    /// Least recently used first.
    entries: Vec<Entry>,
    hits: u64,
    hit_tokens: u64,
}

impl PrefixStore {
    pub fn new(block_tokens: usize, max_entries: usize) -> Self {
        PrefixStore {
            block_tokens: block_tokens.max(1),
            max_entries,
            state_blocks: 0,
            entries: Vec::new(),
            hits: 0,
            hit_tokens: 0,
        }
    }

    /// This store where a cache's linear states count for `blocks` blocks.
    pub fn with_state_blocks(mut self, blocks: usize) -> Self {
        self.state_blocks = blocks;
        self
    }

    /// Prompts that started from a kept prefix, and the prompt tokens they did not prefill.
    pub fn hits(&self) -> (u64, u64) {
        (self.hits, self.hit_tokens)
    }

    /// Blocks the kept caches hold.
    pub fn blocks(&self) -> usize {
        let whole: usize = self
            .entries
            .iter()
            .map(|e| match e.cache.has_state() {
                true => e.tokens.len().div_ceil(self.block_tokens) + self.state_blocks,
                false => e.tokens.len() / self.block_tokens,
            })
            .sum();
        let shared: f64 = self.entries.iter().map(|e| e.cache.shared_blocks()).sum();
        whole - shared.floor() as usize
    }

    /// Blocks of `prompt` a kept prefix can stand for ([`PrefixStore::reuse`]).
    pub fn reusable_blocks(&self, prompt: &[u32]) -> usize {
        let positions = self.entries.iter().map(|e| self.reusable(e, prompt)).max();
        positions.unwrap_or(0) / self.block_tokens
    }

    /// [`leading_block_key`] of each kept prefix at least a block long: what a router with
    /// several stores (one per dense replica) sends a prompt by, to the store that can
    /// reuse its start.
    pub fn leading_block_keys(&self) -> Vec<u64> {
        self.entries
            .iter()
            .filter_map(|e| leading_block_key(&e.tokens, self.block_tokens))
            .collect()
    }

    /// Drops the least recently used prefix; false when none is kept.
    pub fn evict_oldest(&mut self) -> bool {
        if self.entries.is_empty() {
            return false;
        }
        self.entries.remove(0);
        true
    }

    /// Positions of `prompt` a kept prefix can stand for: whole blocks in common, leaving at
    /// least one prompt token to compute (its logits choose the next token).
    fn reusable(&self, entry: &Entry, prompt: &[u32]) -> usize {
        let common = entry
            .tokens
            .iter()
            .zip(prompt)
            .take_while(|(a, b)| a == b)
            .count();
        let limit = prompt.len().saturating_sub(1);
        if entry.cache.has_state() {
            // All of it or nothing: its states sum up exactly its positions.
            let whole = entry.tokens.len();
            return if common == whole && whole <= limit {
                whole
            } else {
                0
            };
        }
        common.min(limit) / self.block_tokens * self.block_tokens
    }

    /// A copy of the cache of the longest kept prefix of `prompt`, cut to the positions it
    /// stands for, and that number; `None` when no whole block is in common.
    pub fn reuse(
        &mut self,
        prompt: &[u32],
        copy: &mut impl FnMut(&KvCache) -> Result<KvCache, EngineError>,
    ) -> Option<(KvCache, usize)> {
        let (best, positions) = self
            .entries
            .iter()
            .enumerate()
            .map(|(i, e)| (i, self.reusable(e, prompt)))
            .max_by_key(|&(_, positions)| positions)?;
        if positions == 0 {
            return None;
        }
        let mut cache = copy(&self.entries[best].cache).ok()?;
        cache.truncate(positions);
        if cache.len() != positions {
            return None;
        }
        let entry = self.entries.remove(best);
        self.entries.push(entry);
        self.hits += 1;
        self.hit_tokens += positions as u64;
        Some((cache, positions))
    }

    /// Keeps the whole blocks of `prompt` that `cache` holds (just prefilled), unless a kept
    /// prefix already covers them.
    pub fn keep(
        &mut self,
        prompt: &[u32],
        cache: &KvCache,
        copy: &mut impl FnMut(&KvCache) -> Result<KvCache, EngineError>,
    ) {
        if self.max_entries == 0 {
            return;
        }
        let positions = if cache.has_state() {
            // Kept whole (see the module comment), if it holds nothing beyond the prompt.
            if cache.len() > prompt.len() {
                return;
            }
            cache.len()
        } else {
            cache.len().min(prompt.len()) / self.block_tokens * self.block_tokens
        };
        if positions == 0 {
            return;
        }
        let tokens = &prompt[..positions];
        // A kept cache with states serves only prompts that start with all of it: a longer
        // one does not cover this one, nor this one a shorter one.
        let whole = cache.has_state();
        if let Some(i) = self.entries.iter().position(|e| {
            (e.tokens.len() == positions || (!whole && e.tokens.len() > positions))
                && e.tokens[..positions] == *tokens
        }) {
            let entry = self.entries.remove(i);
            self.entries.push(entry);
            return;
        }
        if !whole {
            // A shorter kept prefix of this one is superseded.
            self.entries
                .retain(|e| !(e.tokens.len() < positions && tokens[..e.tokens.len()] == e.tokens));
        }
        let Ok(mut kept) = copy(cache) else {
            return;
        };
        kept.truncate(positions);
        if kept.len() != positions {
            return;
        }
        self.entries.push(Entry {
            tokens: tokens.to_vec(),
            cache: kept,
        });
        while self.entries.len() > self.max_entries {
            self.entries.remove(0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ModelConfig;

    fn cache_of(len: usize) -> KvCache {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen3_moe");
        let mut cache = KvCache::new(&ModelConfig::load(&dir).unwrap());
        for layer in &mut cache.layers {
            let (a, b) = (layer.first_width(), layer.second_width());
            layer.first = (0..len * a).map(|v| v as f32).collect();
            layer.second = (0..len * b).map(|v| v as f32).collect();
        }
        cache.advance(len);
        cache
    }

    fn copy(cache: &KvCache) -> Result<KvCache, EngineError> {
        cache.host_copy().ok_or(EngineError::ForeignCache)
    }

    #[test]
    fn the_longest_prefix_in_whole_blocks_is_reused_leaving_a_token_to_compute() {
        let mut store = PrefixStore::new(4, 2);
        let prompt: Vec<u32> = (0..11).collect();
        store.keep(&prompt, &cache_of(11), &mut copy);
        assert_eq!(store.blocks(), 2, "8 of 11 positions: two whole blocks");
        // Shares 10 tokens: two whole blocks.
        let mut other: Vec<u32> = (0..10).collect();
        other.extend([99, 98]);
        let (cache, positions) = store.reuse(&other, &mut copy).unwrap();
        assert_eq!((positions, cache.len()), (8, 8));
        assert_eq!(
            cache.layers[0].first.len(),
            8 * cache.layers[0].first_width()
        );
        // The same 8-token prompt: at most 7 positions may be reused, so one block.
        let (_, positions) = store.reuse(&prompt[..8], &mut copy).unwrap();
        assert_eq!(positions, 4);
        // Nothing in common, or less than a block.
        assert!(store.reuse(&[5, 6, 7, 8, 9], &mut copy).is_none());
        assert!(store.reuse(&[0, 1, 2, 9, 9, 9], &mut copy).is_none());
        assert_eq!(store.hits(), (2, 12));
    }

    /// A cache of the hybrid fixture holding `len` positions and a state.
    fn hybrid_cache_of(len: usize) -> KvCache {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen3_next");
        let mut cache = KvCache::new(&ModelConfig::load(&dir).unwrap());
        for layer in &mut cache.layers {
            let (a, b) = (layer.first_width(), layer.second_width());
            layer.first = vec![0.5; len * a];
            layer.second = vec![0.5; len * b];
            if let Some(state) = &mut layer.linear {
                state.recurrent = vec![len as f32; 4];
            }
        }
        cache.advance(len);
        cache
    }

    #[test]
    fn a_hybrid_cache_is_kept_whole_and_reused_only_where_it_ends_exactly() {
        let mut store = PrefixStore::new(4, 2).with_state_blocks(3);
        let prompt: Vec<u32> = (0..11).collect();
        store.keep(&prompt, &hybrid_cache_of(11), &mut copy);
        assert_eq!(
            store.blocks(),
            3 + 3,
            "11 positions in 3 blocks, and the state"
        );
        // All 11 and more: reused whole, state and all.
        let mut longer = prompt.clone();
        longer.extend([50, 51]);
        let (cache, positions) = store.reuse(&longer, &mut copy).unwrap();
        assert_eq!((positions, cache.len()), (11, 11));
        let state = cache.layers[0].linear.as_ref().unwrap();
        assert_eq!(state.recurrent, vec![11.0; 4]);
        // Sharing 10 of its 11 (or all of it with nothing left to compute): nothing.
        let mut other: Vec<u32> = (0..10).collect();
        other.extend([99, 98]);
        assert!(store.reuse(&other, &mut copy).is_none());
        assert!(store.reuse(&prompt, &mut copy).is_none());
        // A cache cut short forgets everything rather than keep a state of other positions.
        let mut cache = hybrid_cache_of(8);
        assert!(!cache.can_truncate_to(4));
        cache.truncate(4);
        assert_eq!(cache.len(), 0);
        assert!(
            cache.layers[0]
                .linear
                .as_ref()
                .unwrap()
                .recurrent
                .is_empty()
        );
    }

    #[test]
    fn kept_prefixes_are_bounded_superseded_and_evicted_oldest_first() {
        let mut store = PrefixStore::new(4, 2);
        let a: Vec<u32> = (0..8).collect();
        store.keep(&a[..4], &cache_of(4), &mut copy);
        store.keep(&a, &cache_of(8), &mut copy);
        assert_eq!(
            store.blocks(),
            2,
            "the longer prefix replaced the shorter one"
        );
        store.keep(&a, &cache_of(8), &mut copy);
        assert_eq!(store.blocks(), 2, "kept once");
        let b: Vec<u32> = (100..108).collect();
        let c: Vec<u32> = (200..204).collect();
        store.keep(&b, &cache_of(8), &mut copy);
        store.keep(&c, &cache_of(4), &mut copy);
        assert_eq!(store.blocks(), 3, "two entries at most: `a` went");
        assert!(
            store
                .reuse(&[0, 1, 2, 3, 4, 5, 6, 7, 8], &mut copy)
                .is_none()
        );
        assert!(store.evict_oldest());
        assert!(store.evict_oldest());
        assert!(!store.evict_oldest());
        assert_eq!(store.blocks(), 0);
    }
}
