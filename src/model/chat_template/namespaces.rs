//! Namespaces that cannot hold themselves.
//!
//! A namespace is the one value a template can change after making it, and so the one way a
//! template can make a value that contains itself: `{% set ns.me = ns %}`, or the same
//! through a list, a map or another namespace. minijinja prints, hashes, compares and
//! serialises a value by recursing into it; a value that contains itself recurses until the
//! stack overflows, which aborts the process. Neither the fuel nor any stack size bounds
//! that recursion.
//!
//! So before a template is compiled, every `{% set name.attr = value %}` is rewritten to
//! `{% set name.attr = (value)|__namespace_value(name, 'name.attr') %}`. The filter walks
//! the value as printing it would (lists, maps, namespaces and iterables, item by item) and
//! fails the render if the walk reaches `name`. The other places Jinja's grammar lets a
//! template assign to an attribute (`for` targets, tuples, `with`, a filtered
//! `{% set name.attr | f %}` block) are refused when the template loads: Jinja2 accepts
//! attribute targets in `set` alone, and no published template uses them elsewhere.
//!
//! The rewrite adds characters inside lines (no new lines), so errors still name the line.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use minijinja::machinery::{Token, WhitespaceConfig, ast, parse, tokenize};
use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Object, ValueKind};
use minijinja::{Error, ErrorKind, State, Value};

/// The filter every `{% set name.attr = value %}` passes its value through.
pub const FILTER: &str = "__namespace_value";

/// Values (items, keys and values, counted each time they are walked) that the checks of
/// one render may walk in all. A template walks the value it stores each time it stores
/// it: appending item by item to a list kept in a namespace walks the list again each
/// time, so this allows a list of about 2800 items built that way (published templates
/// store flags, indices and strings) and bounds the time a hostile template spends here to
/// a fraction of a second.
pub const WALK_BUDGET: u64 = 4_000_000;

/// What this render's checks have walked (a temp object of the render's state, shared
/// with the macros it calls).
#[derive(Debug, Default)]
struct Walks {
    /// Values walked, in all.
    walked: AtomicU64,
    /// Lists walked whole that hold no namespace, however deep (nothing in them can change),
    /// by address, each kept alive here so that its address is not reused: a template that
    /// nests a list one more level each time walks the new level only.
    immutable: Mutex<HashMap<usize, Value>>,
}

impl Object for Walks {}

/// The list `value` is, if it is one, and its address.
fn list(value: &Value) -> Option<(&Vec<Value>, usize)> {
    let items = value.downcast_object_ref::<Vec<Value>>()?;
    Some((items, std::ptr::from_ref(items) as usize))
}

/// The filter: `value` as it is, unless storing it in `namespace` would make the namespace
/// contain itself.
pub fn namespace_value(
    state: &State,
    value: Value,
    namespace: Value,
    target: &str,
) -> Result<Value, Error> {
    // Not a namespace: the assignment itself fails, with minijinja's own error.
    if namespace.as_object().is_none() {
        return Ok(value);
    }
    let walks = state.get_or_set_temp_object("moe-node.namespace-walks", Walks::default);
    let mut immutable = walks.immutable.lock().unwrap_or_else(|e| e.into_inner());
    let left = WALK_BUDGET.saturating_sub(walks.walked.load(Ordering::Relaxed));
    let mut count = 0u64;
    // Whether every object met is a list (so the value can never change).
    let mut only_lists = true;
    let mut pending = vec![value.clone()];
    while let Some(item) = pending.pop() {
        count += 1;
        if count > left {
            walks.walked.store(WALK_BUDGET, Ordering::Relaxed);
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!(
                    "the chat template stores values in namespaces beyond the {WALK_BUDGET} \
                     items a render may check (at `{target}`)"
                ),
            ));
        }
        // Strings, numbers, none: nothing inside.
        if item.as_object().is_none() {
            continue;
        }
        if let Some((items, address)) = list(&item) {
            if !immutable.contains_key(&address) {
                pending.extend(items.iter().cloned());
            }
            continue;
        }
        only_lists = false;
        if minijinja::tests::is_sameas(&item, &namespace) {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!(
                    "the chat template stores a namespace inside itself (`{target}`): \
                     printing or comparing it would never end"
                ),
            ));
        }
        match item.kind() {
            ValueKind::Map => {
                for key in item.try_iter()? {
                    pending.push(item.get_item(&key)?);
                    pending.push(key);
                }
            }
            ValueKind::Seq | ValueKind::Iterable => pending.extend(item.try_iter()?),
            // Macros, loops and other objects print as a name, not as what they hold.
            _ => {}
        }
    }
    walks.walked.fetch_add(count, Ordering::Relaxed);
    if only_lists && let Some((_, address)) = list(&value) {
        immutable.insert(address, value.clone());
    }
    Ok(value)
}

/// `source` with every `{% set name.attr = value %}` checked by [`FILTER`]; an error for
/// a template that does not parse or assigns to an attribute anywhere else.
pub fn guard(source: &str, name: &str) -> Result<String, String> {
    let parse = |source| {
        parse(source, name, syntax(), WhitespaceConfig::default())
            .map_err(|e| format!("chat template does not parse: {e}"))
    };
    let template = parse(source)?;
    let mut stores = Vec::new();
    visit(&template, &mut stores)?;
    if stores.is_empty() {
        return Ok(source.to_string());
    }
    // Each value runs from the `=` after its target to the end of the statement (the
    // syntax tree's spans of some expressions, filters for one, start inside them).
    let tokens = tokenize(source, false, syntax(), WhitespaceConfig::default())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("chat template does not parse: {e}"))?;
    let mut values = Vec::with_capacity(stores.len());
    for store in &stores {
        let mut after = tokens
            .iter()
            .skip_while(|(_, span)| (span.start_offset as usize) < store.target_end);
        let assign = after.find(|(token, _)| matches!(token, Token::Assign));
        let end = after.find(|(token, _)| matches!(token, Token::BlockEnd));
        let (Some((_, assign)), Some((_, end))) = (assign, end) else {
            return Err(cannot_guard(&store.target));
        };
        values.push((assign.end_offset as usize, end.start_offset as usize, store));
    }
    // Wrapped from the last to the first, so that offsets stay valid.
    values.sort_by_key(|&(start, _, _)| start);
    let mut guarded = source.to_string();
    for &(start, end, store) in values.iter().rev() {
        if start > end || !guarded.is_char_boundary(start) || !guarded.is_char_boundary(end) {
            return Err(cannot_guard(&store.target));
        }
        guarded.insert_str(
            end,
            &format!(")|{FILTER}({}, '{}')", store.namespace, store.target),
        );
        guarded.insert(start, '(');
    }
    // The rewritten template must parse, with the filter outermost in every such value:
    // then it checks the whole value, whatever the spans covered.
    let rewritten = parse(&guarded)?;
    let mut checked = Vec::new();
    visit(&rewritten, &mut checked)?;
    if checked.len() != stores.len() || checked.iter().any(|store| !store.guarded) {
        return Err(cannot_guard(&stores[0].target));
    }
    Ok(guarded)
}

/// The syntax the node's environment uses: minijinja's default (a unit struct unless its
/// `custom_syntax` feature is on).
#[allow(clippy::default_constructed_unit_structs)]
fn syntax() -> SyntaxConfig {
    SyntaxConfig::default()
}

fn cannot_guard(target: &str) -> String {
    format!("chat template: cannot check the value stored in `{target}`")
}

/// One `{% set namespace.attr = value %}`.
struct Store {
    namespace: String,
    target: String,
    /// Where the target (`namespace.attr`) ends in the source.
    target_end: usize,
    /// Whether the value is already `(...)|__namespace_value(namespace, ...)`.
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
                    namespace: namespace.id.to_string(),
                    target: format!("{}.{}", namespace.id, attr.name),
                    target_end: set.target.span().end_offset as usize,
                    guarded: is_guarded(&set.expr, namespace.id),
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

/// Whether `value` is `...|__namespace_value(namespace, ...)`.
fn is_guarded(value: &ast::Expr<'_>, namespace: &str) -> bool {
    let ast::Expr::Filter(filter) = value else {
        return false;
    };
    filter.name == FILTER
        && filter.expr.is_some()
        && matches!(
            filter.args.first(),
            Some(ast::CallArg::Pos(ast::Expr::Var(var))) if var.id == namespace
        )
}
