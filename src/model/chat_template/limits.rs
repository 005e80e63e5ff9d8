//! The limits every render runs under, in this process or in a worker process.

/// Instructions one render may run. A published template spends tens per message (a prompt
/// of `max_prompt_tokens` holds a few thousand messages at most); this bounds a hostile one
/// (`{% for i in range(99999) %}{% for j in range(99999) %}`) to well under a second
/// instead of forever. It also bounds how deeply a render can nest a value (about one level
/// per instruction: `{% set ns.a = [[[ns.a]]] %}` in a loop), and so the stack that
/// printing, comparing or sorting that value needs: see [`RENDER_STACK_BYTES`].
pub const RENDER_FUEL: u64 = 1_000_000;
/// Stack of the thread a render runs on. Printing, comparing, hashing, sorting and dropping
/// a nested value recurse once per level, using up to ~650 bytes each (measured); the fuel
/// allows at most ~1 M levels. Reserved, not touched: a render that nests nothing uses a
/// few pages of it.
pub const RENDER_STACK_BYTES: usize = 1 << 30;
/// Nesting depth (macros, loops, includes) a render may reach. Published templates nest a
/// few levels; minijinja's default is 500, and a render runs on an HTTP worker's 2 MiB stack.
pub const MAX_RECURSION: usize = 100;
/// Largest prompt text a render may produce; far beyond any context window.
pub const MAX_OUTPUT_BYTES: usize = 16 << 20;
