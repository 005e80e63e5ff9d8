//! Namespaces hold plain values, so no value can contain itself.
//!
//! A namespace is the one value a template can change after making it, and so the one way a
//! template could make a value that contains itself: `{% set ns.me = ns %}`, or the same
//! through a list, a map, another namespace or a live view of one (`ns.values()`,
//! `ns|items`). minijinja prints, hashes, compares and serialises a value by recursing into
//! it; a value that contains itself recurses until the stack overflows, which aborts the
//! process. Neither the fuel nor any stack size bounds that recursion.
//!
//! So what a namespace holds is copied in as plain data: strings, numbers, lists and maps
//! (namespaces, views, loops, macros and other iterables or maps become the lists and maps
//! of what they hold at that moment; cyclers, joiners and other objects that are neither
//! are refused). Nothing a namespace holds can then reach a namespace, and lists and maps
//! cannot change, so no value reaches itself. Before a template is compiled, every `{% set name.attr = value %}` is rewritten
//! to `{% set name.attr = (value)|__namespace_value('name.attr') %}`, and `namespace(...)`
//! copies its initial values the same way. A filtered block set with an attribute target
//! (`{% set ns.x | f %}...{% endset %}`, which Jinja2 accepts) is refused when the template
//! loads, as is any other attribute target (minijinja's grammar has none today). Published
//! templates store flags, indices, strings and messages: they render as before.
//!
//! The rewrite adds characters inside lines (no new lines), so errors still name the line.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, TryLockError};

use indexmap::IndexMap;
use minijinja::machinery::{Token, ast};
use minijinja::value::{Object, ValueKind};
use minijinja::{Error, ErrorKind, State, Value};
use rustc_hash::FxHashMap;

/// The filter every `{% set name.attr = value %}` passes its value through.
pub const FILTER: &str = "__namespace_value";

/// Values (items, keys and values, each time they are met) that the copies of one render
/// may visit in all, each new list or map counting as [`NEW_CONTAINER_COST`] more. Lists
/// and maps found plain are not copied at all, and once copied or found they are not
/// visited again; but a list grown item by item in a namespace (`{% set ns.l = ns.l + [x]
/// %}`) is visited whole at each store: this allows about 2800 items built that way, and
/// bounds what a hostile template spends here to a fraction of a second and about 150 MB
/// (at most 250k new containers, and 4M list slots).
pub const COPY_BUDGET: u64 = 4_000_000;

/// What one new list or map counts against [`COPY_BUDGET`]: its allocation and its entry
/// among the plain values remembered.
pub const NEW_CONTAINER_COST: u64 = 16;

/// Deepest a value stored in a namespace may nest lists and maps not stored before (as
/// Python's recursion limit).
pub const MAX_DEPTH: usize = 1000;

/// What this render's copies have done (a temp object of the render's state, shared with
/// the macros it calls).
#[derive(Debug, Default)]
struct Copies {
    /// Values visited, in all.
    visited: AtomicU64,
    /// The plain lists and maps made or found so far, by address, each kept alive here so
    /// that its address is not reused: a list nested one level more at each store copies
    /// the new level only, and a list stored again is not visited again.
    plain: Mutex<FxHashMap<usize, Value>>,
}

impl Object for Copies {}

/// minijinja's maps (`ValueMap` with its `preserve_order` feature).
type Map = IndexMap<Value, Value>;

/// The address of the list or map `value` is, if it is one of minijinja's own.
fn plain_address(value: &Value) -> Option<usize> {
    if let Some(list) = value.downcast_object_ref::<Vec<Value>>() {
        return Some(std::ptr::from_ref(list) as usize);
    }
    let map = value.downcast_object_ref::<Map>()?;
    Some(std::ptr::from_ref(map) as usize)
}

/// The filter: `value` as plain data.
pub fn namespace_value(state: &State, value: Value, target: &str) -> Result<Value, Error> {
    copy_plain(state, value, &format!("`{target}`"))
}

/// The `namespace(...)` function: minijinja's, with its initial values copied as plain data.
pub fn namespace(state: &State, defaults: Option<Value>) -> Result<Value, Error> {
    let defaults = defaults
        .map(|d| copy_plain(state, d, "`namespace(...)`"))
        .transpose()?;
    minijinja::functions::namespace(defaults)
}

fn copy_plain(state: &State, value: Value, target: &str) -> Result<Value, Error> {
    let copies = state.get_or_set_temp_object("moe-node.namespace-copies", Copies::default);
    // Held while copying: nothing a copy calls renders template code (minijinja's lazy
    // values are its own iterators), and should that change, this fails rather than waits.
    let mut plain = match copies.plain.try_lock() {
        Ok(plain) => plain,
        Err(TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
        Err(TryLockError::WouldBlock) => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "a value stored in a namespace stores another while it is copied",
            ));
        }
    };
    let mut copier = Copier {
        left: COPY_BUDGET.saturating_sub(copies.visited.load(Ordering::Relaxed)),
        visited: 0,
        plain: &mut plain,
        target,
    };
    let copied = copier.copy(value, 0).map(|(copied, _)| copied);
    copies.visited.fetch_add(copier.visited, Ordering::Relaxed);
    copied
}

struct Copier<'a> {
    left: u64,
    visited: u64,
    plain: &'a mut FxHashMap<usize, Value>,
    /// What is stored, for errors.
    target: &'a str,
}

impl Copier<'_> {
    /// `value` as plain data, and whether that is `value` itself (a list or map holding
    /// plain data only, or a string, a number, ...).
    fn copy(&mut self, value: Value, depth: usize) -> Result<(Value, bool), Error> {
        self.charge(1)?;
        // Strings, numbers, none: values, not objects.
        if value.as_object().is_none() {
            return Ok((value, true));
        }
        let address = plain_address(&value);
        if address.is_some_and(|address| self.plain.contains_key(&address)) {
            return Ok((value, true));
        }
        if depth >= MAX_DEPTH {
            return Err(self.error(format!("nests lists and maps over {MAX_DEPTH} levels deep")));
        }
        // Only minijinja's own lists and maps may be kept as they are.
        let mut same = address.is_some();
        let copied = match value.kind() {
            ValueKind::Map => {
                let mut map = Map::new();
                for key in value.try_iter()? {
                    let item = value.get_item(&key)?;
                    let (key, key_same) = self.copy(key, depth + 1)?;
                    let (item, item_same) = self.copy(item, depth + 1)?;
                    same &= key_same && item_same;
                    map.insert(key, item);
                }
                (!same).then(|| Value::from_object(map))
            }
            ValueKind::Seq | ValueKind::Iterable => {
                let mut list = Vec::new();
                for item in value.try_iter()? {
                    let (item, item_same) = self.copy(item, depth + 1)?;
                    same &= item_same;
                    list.push(item);
                }
                (!same).then(|| Value::from_object(list))
            }
            kind => {
                return Err(self.error(format!(
                    "is a {kind}: a namespace holds strings, numbers, lists and maps"
                )));
            }
        };
        if copied.is_some() {
            self.charge(NEW_CONTAINER_COST)?;
        }
        let plain = copied.unwrap_or(value);
        if let Some(address) = plain_address(&plain) {
            self.plain.insert(address, plain.clone());
        }
        Ok((plain, same))
    }

    fn charge(&mut self, visits: u64) -> Result<(), Error> {
        self.visited += visits;
        if self.visited > self.left {
            return Err(self.error(format!(
                "copies more than the {COPY_BUDGET} values a render may store in namespaces"
            )));
        }
        Ok(())
    }

    fn error(&self, what: String) -> Error {
        Error::new(
            ErrorKind::InvalidOperation,
            format!("the value stored in {} {what}", self.target),
        )
    }
}

/// `source` with every `{% set name.attr = value %}` storing its value through [`FILTER`];
/// an error for a template that does not parse or assigns to an attribute anywhere else.
pub fn guard(source: &str, name: &str) -> Result<String, String> {
    let parse = |source| super::parse_source(source, name);
    let template = parse(source)?;
    let mut stores = Vec::new();
    visit(&template, &mut stores)?;
    if stores.is_empty() {
        return Ok(source.to_string());
    }
    // Each value runs from the `=` after its target to the end of the statement (the
    // syntax tree's spans of some expressions, filters for one, start inside them).
    let tokens = super::source_tokens(source)?;
    let mut values = Vec::with_capacity(stores.len());
    for store in &stores {
        let first =
            tokens.partition_point(|(_, span)| (span.start_offset as usize) < store.target_end);
        let mut after = tokens[first..].iter();
        let assign = after.find(|(token, _)| matches!(token, Token::Assign));
        let end = after.find(|(token, _)| matches!(token, Token::BlockEnd));
        let (Some((_, assign)), Some((_, end))) = (assign, end) else {
            return Err(cannot_guard(&store.target));
        };
        values.push((assign.end_offset as usize, end.start_offset as usize, store));
    }
    // One pass from the first value to the last.
    values.sort_by_key(|&(start, _, _)| start);
    let mut guarded = String::with_capacity(source.len() + values.len() * 64);
    let mut copied = 0;
    for &(start, end, store) in &values {
        let (Some(before), Some(value)) = (source.get(copied..start), source.get(start..end))
        else {
            return Err(cannot_guard(&store.target));
        };
        guarded.push_str(before);
        guarded.push('(');
        guarded.push_str(value);
        guarded.push_str(&format!(")|{FILTER}('{}')", store.target));
        copied = end;
    }
    guarded.push_str(&source[copied..]);
    // The rewritten template must parse, with the filter outermost in every such value:
    // then it copies the whole value, whatever the spans covered.
    let rewritten = parse(&guarded)?;
    let mut checked = Vec::new();
    visit(&rewritten, &mut checked)?;
    if checked.len() != stores.len() || checked.iter().any(|store| !store.guarded) {
        return Err(cannot_guard(&stores[0].target));
    }
    Ok(guarded)
}

fn cannot_guard(target: &str) -> String {
    format!("chat template: cannot copy the value stored in `{target}` as plain data")
}

/// One `{% set namespace.attr = value %}`.
struct Store {
    target: String,
    /// Where the target (`namespace.attr`) ends in the source.
    target_end: usize,
    /// Whether the value is already `...|__namespace_value(...)`.
    guarded: bool,
}

fn visit(stmt: &ast::Stmt<'_>, stores: &mut Vec<Store>) -> Result<(), String> {
    let body = |body: &[ast::Stmt<'_>], stores: &mut Vec<Store>| {
        body.iter().try_for_each(|stmt| visit(stmt, stores))
    };
    match stmt {
        ast::Stmt::Template(template) => body(&template.children, stores),
        ast::Stmt::Set(set) => match &set.target {
            ast::Expr::GetAttr(attr) => {
                let ast::Expr::Var(namespace) = &attr.expr else {
                    return Err(refused(
                        "assigns to an attribute of something other than a variable",
                    ));
                };
                stores.push(Store {
                    target: format!("{}.{}", namespace.id, attr.name),
                    target_end: set.target.span().end_offset as usize,
                    guarded: matches!(&set.expr, ast::Expr::Filter(f) if f.name == FILTER && f.expr.is_some()),
                });
                Ok(())
            }
            target if assigns_attribute(target) => {
                Err(refused("assigns to an attribute in a tuple"))
            }
            _ => Ok(()),
        },
        ast::Stmt::SetBlock(set) => {
            if set.filter.is_some() && assigns_attribute(&set.target) {
                return Err(refused("filters a block it assigns to an attribute"));
            }
            body(&set.body, stores)
        }
        ast::Stmt::ForLoop(for_loop) => {
            if assigns_attribute(&for_loop.target) {
                return Err(refused("loops with an attribute as its target"));
            }
            body(&for_loop.body, stores)?;
            body(&for_loop.else_body, stores)
        }
        ast::Stmt::WithBlock(with) => {
            if with
                .assignments
                .iter()
                .any(|(target, _)| assigns_attribute(target))
            {
                return Err(refused("assigns to an attribute in `with`"));
            }
            body(&with.body, stores)
        }
        ast::Stmt::IfCond(cond) => {
            body(&cond.true_body, stores)?;
            body(&cond.false_body, stores)
        }
        ast::Stmt::AutoEscape(block) => body(&block.body, stores),
        ast::Stmt::FilterBlock(block) => body(&block.body, stores),
        ast::Stmt::Block(block) => body(&block.body, stores),
        ast::Stmt::Macro(decl) => body(&decl.body, stores),
        ast::Stmt::CallBlock(call) => body(&call.macro_decl.body, stores),
        ast::Stmt::EmitExpr(_)
        | ast::Stmt::EmitRaw(_)
        | ast::Stmt::Import(_)
        | ast::Stmt::FromImport(_)
        | ast::Stmt::Extends(_)
        | ast::Stmt::Include(_)
        | ast::Stmt::Do(_) => Ok(()),
    }
}

fn refused(what: &str) -> String {
    format!(
        "chat template {what}; templates may assign to an attribute only as \
         `{{% set name.attr = value %}}`"
    )
}

/// Whether an assignment target is or holds `x.attr`.
fn assigns_attribute(target: &ast::Expr<'_>) -> bool {
    match target {
        ast::Expr::GetAttr(_) => true,
        ast::Expr::List(list) => list.items.iter().any(assigns_attribute),
        _ => false,
    }
}
