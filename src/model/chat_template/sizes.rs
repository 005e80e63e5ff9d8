//! Sizes one operation of a render may ask for.
//!
//! A few of minijinja's operations make a value whose size an argument sets, and allocate
//! it whole at once: a list repeated (`[0] * 10**12` is lazy, but every filter or slice that
//! collects it reserves room for all its items first), `batch` and `slice` (a list of
//! `count` slots), `indent` (`width` spaces a line), `replace` and `join` (the new text or
//! the separator as many times as it occurs or there are items), and the widths and precisions of
//! `format` and `str.format` (`"%999999999999d"`). An allocation that large fails, and a
//! failed allocation aborts the process; one a little smaller takes the machine's memory.
//! Nothing of the fuel bounds them, since each is one instruction.
//!
//! So these are checked before they run, against sizes no chat template comes near: a list
//! of [`MAX_ITEMS`] items, text of [`MAX_OUTPUT_BYTES`] (what a whole render may print).
//! Multiplication is rewritten before the template is compiled: every `a * b` becomes
//! `((a)|__times(b))`, which checks the size of a repeated list or string, then multiplies
//! as minijinja does. The rewrite adds characters inside lines (no new lines), so errors
//! still name the line.
//!
//! What stays unchecked is memory grown a step at a time (a string doubled in a loop): a
//! render in the node runs in a worker process with a memory limit and a deadline (see
//! `template_worker`), which ends it with a clear error whatever it does.

use std::sync::LazyLock;

use minijinja::machinery::{Token, WhitespaceConfig, ast, parse, tokenize};
use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Kwargs, Rest, StringInput, ValueKind};
use minijinja::{Environment, Error, ErrorKind, Expression, State, Value, context};

use super::MAX_OUTPUT_BYTES;

/// The most items a list made by repeating one may hold, and the most slots `batch` and
/// `slice` may make (a list of them takes 24 MiB).
pub const MAX_ITEMS: usize = 1 << 20;

/// The filter every `a * b` is rewritten to.
pub const TIMES: &str = "__times";

/// minijinja's own multiplication, on a plain environment of its own (its operators are
/// not public API).
static PRODUCT: LazyLock<Expression<'static, 'static>> = LazyLock::new(|| {
    let env: &'static Environment<'static> = Box::leak(Box::new(Environment::new()));
    env.compile_expression("a * b")
        .expect("a constant expression compiles")
});

fn too_large(what: String) -> Error {
    Error::new(ErrorKind::InvalidOperation, what)
}

/// `a * b`, refusing a repeated list longer than [`MAX_ITEMS`] items or a repeated string
/// longer than [`MAX_OUTPUT_BYTES`].
pub fn times(a: Value, b: Value) -> Result<Value, Error> {
    for (value, count) in [(&a, &b), (&b, &a)] {
        let Some(n) = count.as_usize() else {
            continue;
        };
        if let Some(text) = value.as_str() {
            if text.len().saturating_mul(n) > MAX_OUTPUT_BYTES {
                return Err(too_large(format!(
                    "a string of {} bytes repeated {n} times is longer than the \
                     {MAX_OUTPUT_BYTES} bytes a render may print",
                    text.len()
                )));
            }
        } else if matches!(value.kind(), ValueKind::Seq | ValueKind::Iterable) {
            let items = value.len().unwrap_or(0);
            if items.saturating_mul(n) > MAX_ITEMS {
                return Err(too_large(format!(
                    "a list of {items} items repeated {n} times holds more than \
                     {MAX_ITEMS} items"
                )));
            }
        }
    }
    PRODUCT.eval(context! { a => a, b => b })
}

fn check_count(filter: &str, count: usize) -> Result<(), Error> {
    if count > MAX_ITEMS {
        return Err(too_large(format!(
            "{filter}({count}) makes more than {MAX_ITEMS} slots"
        )));
    }
    Ok(())
}

/// minijinja's `batch`, for at most [`MAX_ITEMS`] items a batch.
pub fn batch(
    state: &State,
    value: Value,
    count: usize,
    fill_with: Option<Value>,
) -> Result<Value, Error> {
    check_count("batch", count)?;
    minijinja::filters::batch(state, value, count, fill_with)
}

/// minijinja's `slice`, into at most [`MAX_ITEMS`] slices.
pub fn slice(
    state: &State,
    value: Value,
    count: usize,
    fill_with: Option<Value>,
) -> Result<Value, Error> {
    check_count("slice", count)?;
    minijinja::filters::slice(state, value, count, fill_with)
}

/// minijinja's `indent`, when its output (a `width` of spaces on each line) fits in
/// [`MAX_OUTPUT_BYTES`].
pub fn indent(
    value: StringInput<'_>,
    width: Option<usize>,
    first: Option<bool>,
    blank: Option<bool>,
    kwargs: Kwargs,
) -> Result<Value, Error> {
    let named = match width {
        Some(width) => width,
        None => kwargs.peek::<Option<usize>>("width")?.unwrap_or(4),
    };
    let lines = value.as_str().split('\n').count();
    if lines.saturating_mul(named) > MAX_OUTPUT_BYTES {
        return Err(too_large(format!(
            "indent({named}) of {lines} lines is longer than the {MAX_OUTPUT_BYTES} bytes \
             a render may print"
        )));
    }
    minijinja::filters::indent(value, width, first, blank, kwargs)
}

/// minijinja's `replace`, when its result fits in [`MAX_OUTPUT_BYTES`].
pub fn replace(
    state: &State,
    value: StringInput<'_>,
    from: StringInput<'_>,
    to: StringInput<'_>,
) -> Result<Value, Error> {
    let (text, old, new) = (value.as_str(), from.as_str(), to.as_str());
    if new.len() > old.len() {
        let found = if old.is_empty() {
            text.chars().count() + 1
        } else {
            text.matches(old).count()
        };
        let grown = found.saturating_mul(new.len() - old.len());
        if text.len().saturating_add(grown) > MAX_OUTPUT_BYTES {
            return Err(too_large(format!(
                "replace makes {found} replacements of {} bytes in {} bytes: longer than the \
                 {MAX_OUTPUT_BYTES} bytes a render may print",
                new.len(),
                text.len()
            )));
        }
    }
    minijinja::filters::replace(state, value, from, to)
}

/// minijinja's `join`, when the separators alone fit in [`MAX_OUTPUT_BYTES`].
pub fn join(state: &State, value: &Value, joiner: Option<StringInput<'_>>) -> Result<Value, Error> {
    let separator = joiner.as_ref().map_or(0, |joiner| joiner.as_str().len());
    let items = value.len().unwrap_or(0);
    if items.saturating_sub(1).saturating_mul(separator) > MAX_OUTPUT_BYTES {
        return Err(too_large(format!(
            "joining {items} items with {separator} bytes between them is longer than the \
             {MAX_OUTPUT_BYTES} bytes a render may print"
        )));
    }
    minijinja::filters::join(state, value, joiner)
}

/// minijinja's `format` (printf style), when no width or precision in the format string
/// exceeds [`MAX_OUTPUT_BYTES`].
pub fn format(state: &State, format_str: &Value, args: Rest<Value>) -> Result<Value, Error> {
    if let Some(text) = format_str.as_str() {
        check_widths(text, printf_specs(text))?;
    }
    minijinja::filters::format(state, format_str, args)
}

/// The methods Python strings, lists and maps have (minijinja-contrib's `pycompat`), with
/// `str.format` checked as [`format`] is.
pub fn unknown_method(
    state: &State,
    value: &Value,
    method: &str,
    args: &[Value],
) -> Result<Value, Error> {
    if method == "format"
        && let Some(text) = value.as_str()
    {
        check_widths(text, str_format_specs(text))?;
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
}

/// Refuses a format string with a number in a spec (a width or precision) above
/// [`MAX_OUTPUT_BYTES`].
fn check_widths<'a>(text: &str, specs: impl Iterator<Item = &'a str>) -> Result<(), Error> {
    for spec in specs {
        let widest = spec
            .split(|c: char| !c.is_ascii_digit())
            .filter(|digits| !digits.is_empty())
            .map(|digits| digits.parse::<usize>().unwrap_or(usize::MAX))
            .max();
        if let Some(widest) = widest
            && widest > MAX_OUTPUT_BYTES
        {
            return Err(too_large(format!(
                "the format string {:?} asks for a field of {widest} characters, more than \
                 the {MAX_OUTPUT_BYTES} bytes a render may print",
                text.chars().take(80).collect::<String>()
            )));
        }
    }
    Ok(())
}

/// What follows each `%` of a printf-style format string up to its conversion letter
/// (the mapping key, flags, width and precision).
fn printf_specs(text: &str) -> impl Iterator<Item = &str> {
    text.split('%').skip(1).map(|rest| {
        let end = rest
            .find(|c: char| c.is_ascii_alphabetic() || c == '%')
            .unwrap_or(rest.len());
        &rest[..end]
    })
}

/// The format spec (after `:`) of each replacement field of a `str.format` string.
fn str_format_specs(text: &str) -> impl Iterator<Item = &str> {
    text.split('{').skip(1).filter_map(|rest| {
        let field = &rest[..rest.find('}').unwrap_or(rest.len())];
        field.split_once(':').map(|(_, spec)| spec)
    })
}

/// `source` with every `a * b` rewritten to `((a)|__times(b))`; an error for a template
/// that does not parse.
pub fn guard(source: &str, name: &str) -> Result<String, String> {
    let parse = |source| {
        parse(source, name, syntax(), WhitespaceConfig::default())
            .map_err(|e| format!("chat template does not parse: {e}"))
    };
    let template = parse(source)?;
    let mut products = Vec::new();
    visit_stmt(&template, &mut |expr| {
        if let ast::Expr::BinOp(op) = expr
            && matches!(op.op, ast::BinOpKind::Mul)
        {
            products.push(Product {
                start: op.span().start_offset as usize,
                left_end: op.left.span().end_offset as usize,
                operator: (0, 0),
                end: op.span().end_offset as usize,
            });
        }
    });
    if products.is_empty() {
        return Ok(source.to_string());
    }
    let cannot = || "chat template: cannot check the sizes of its products".to_string();
    // The operator of each: the first `*` after its left operand.
    let tokens = tokenize(source, false, syntax(), WhitespaceConfig::default())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("chat template does not parse: {e}"))?;
    for product in &mut products {
        let first =
            tokens.partition_point(|(_, span)| (span.start_offset as usize) < product.left_end);
        let (_, span) = tokens[first..]
            .iter()
            .find(|(token, _)| matches!(token, Token::Mul))
            .ok_or_else(cannot)?;
        product.operator = (span.start_offset as usize, span.end_offset as usize);
    }
    // Outer products before those they hold.
    products.sort_by_key(|p| (p.start, std::cmp::Reverse(p.end)));
    let mut rewritten = String::with_capacity(source.len() + products.len() * 16);
    let mut next = 0;
    emit(
        source,
        &products,
        &mut next,
        0,
        source.len(),
        &mut rewritten,
    )
    .ok_or_else(cannot)?;
    // The rewritten template must parse, with every product gone into the filter.
    let checked = parse(&rewritten)?;
    let (mut left, mut filters) = (0, 0);
    visit_stmt(&checked, &mut |expr| match expr {
        ast::Expr::BinOp(op) if matches!(op.op, ast::BinOpKind::Mul) => left += 1,
        ast::Expr::Filter(filter) if filter.name == TIMES => filters += 1,
        _ => {}
    });
    if left != 0 || next != products.len() || filters < products.len() {
        return Err(cannot());
    }
    Ok(rewritten)
}

/// One `a * b` of the source: where it starts, where its left operand and its operator
/// end, where it ends (byte offsets).
#[derive(Clone, Copy)]
struct Product {
    start: usize,
    left_end: usize,
    operator: (usize, usize),
    end: usize,
}

/// Copies `source[from..to]` with the products starting there (from `products[*next]` on,
/// in order of their starts) rewritten; `None` where the spans do not nest.
fn emit(
    source: &str,
    products: &[Product],
    next: &mut usize,
    from: usize,
    to: usize,
    out: &mut String,
) -> Option<()> {
    let mut copied = from;
    while let Some(&product) = products.get(*next).filter(|p| p.start < to) {
        *next += 1;
        let (operator_start, operator_end) = product.operator;
        if product.start < copied
            || product.end > to
            || !(product.start <= operator_start && operator_end <= product.end)
        {
            return None;
        }
        out.push_str(source.get(copied..product.start)?);
        out.push_str("((");
        emit(source, products, next, product.start, operator_start, out)?;
        out.push_str(")|");
        out.push_str(TIMES);
        out.push('(');
        emit(source, products, next, operator_end, product.end, out)?;
        out.push_str("))");
        copied = product.end;
    }
    out.push_str(source.get(copied..to)?);
    Some(())
}

/// The syntax the node's environment uses: minijinja's default (a unit struct unless its
/// `custom_syntax` feature is on).
#[allow(clippy::default_constructed_unit_structs)]
fn syntax() -> SyntaxConfig {
    SyntaxConfig::default()
}

/// Calls `f` on every expression of `stmt`, outer ones before those they hold.
fn visit_stmt(stmt: &ast::Stmt<'_>, f: &mut dyn FnMut(&ast::Expr<'_>)) {
    let body = |body: &[ast::Stmt<'_>], f: &mut dyn FnMut(&ast::Expr<'_>)| {
        for stmt in body {
            visit_stmt(stmt, f);
        }
    };
    match stmt {
        ast::Stmt::Template(template) => body(&template.children, f),
        ast::Stmt::EmitExpr(emit) => visit_expr(&emit.expr, f),
        ast::Stmt::EmitRaw(_) => {}
        ast::Stmt::ForLoop(for_loop) => {
            visit_expr(&for_loop.target, f);
            visit_expr(&for_loop.iter, f);
            if let Some(filter) = &for_loop.filter_expr {
                visit_expr(filter, f);
            }
            body(&for_loop.body, f);
            body(&for_loop.else_body, f);
        }
        ast::Stmt::IfCond(cond) => {
            visit_expr(&cond.expr, f);
            body(&cond.true_body, f);
            body(&cond.false_body, f);
        }
        ast::Stmt::WithBlock(with) => {
            for (target, value) in &with.assignments {
                visit_expr(target, f);
                visit_expr(value, f);
            }
            body(&with.body, f);
        }
        ast::Stmt::Set(set) => {
            visit_expr(&set.target, f);
            visit_expr(&set.expr, f);
        }
        ast::Stmt::SetBlock(set) => {
            visit_expr(&set.target, f);
            if let Some(filter) = &set.filter {
                visit_expr(filter, f);
            }
            body(&set.body, f);
        }
        ast::Stmt::AutoEscape(block) => {
            visit_expr(&block.enabled, f);
            body(&block.body, f);
        }
        ast::Stmt::FilterBlock(block) => {
            visit_expr(&block.filter, f);
            body(&block.body, f);
        }
        ast::Stmt::Block(block) => body(&block.body, f),
        ast::Stmt::Import(import) => {
            visit_expr(&import.expr, f);
            visit_expr(&import.name, f);
        }
        ast::Stmt::FromImport(import) => {
            visit_expr(&import.expr, f);
            for (name, alias) in &import.names {
                visit_expr(name, f);
                if let Some(alias) = alias {
                    visit_expr(alias, f);
                }
            }
        }
        ast::Stmt::Extends(extends) => visit_expr(&extends.name, f),
        ast::Stmt::Include(include) => visit_expr(&include.name, f),
        ast::Stmt::Macro(decl) => visit_macro(decl, f),
        ast::Stmt::CallBlock(call) => {
            visit_call(&call.call, f);
            visit_macro(&call.macro_decl, f);
        }
        ast::Stmt::Do(call) => visit_call(&call.call, f),
    }
}

fn visit_macro(decl: &ast::Macro<'_>, f: &mut dyn FnMut(&ast::Expr<'_>)) {
    for expr in decl.args.iter().chain(&decl.defaults) {
        visit_expr(expr, f);
    }
    for stmt in &decl.body {
        visit_stmt(stmt, f);
    }
}

fn visit_call(call: &ast::Call<'_>, f: &mut dyn FnMut(&ast::Expr<'_>)) {
    visit_expr(&call.expr, f);
    visit_args(&call.args, f);
}

fn visit_args(args: &[ast::CallArg<'_>], f: &mut dyn FnMut(&ast::Expr<'_>)) {
    for arg in args {
        match arg {
            ast::CallArg::Pos(expr)
            | ast::CallArg::Kwarg(_, expr)
            | ast::CallArg::PosSplat(expr)
            | ast::CallArg::KwargSplat(expr) => visit_expr(expr, f),
        }
    }
}

fn visit_expr(expr: &ast::Expr<'_>, f: &mut dyn FnMut(&ast::Expr<'_>)) {
    f(expr);
    match expr {
        ast::Expr::Var(_) | ast::Expr::Const(_) => {}
        ast::Expr::Slice(slice) => {
            visit_expr(&slice.expr, f);
            for part in [&slice.start, &slice.stop, &slice.step]
                .into_iter()
                .flatten()
            {
                visit_expr(part, f);
            }
        }
        ast::Expr::UnaryOp(op) => visit_expr(&op.expr, f),
        ast::Expr::BinOp(op) => {
            visit_expr(&op.left, f);
            visit_expr(&op.right, f);
        }
        ast::Expr::Compare(compare) => {
            visit_expr(&compare.expr, f);
            for op in &compare.ops {
                visit_expr(&op.expr, f);
            }
        }
        ast::Expr::IfExpr(if_expr) => {
            visit_expr(&if_expr.test_expr, f);
            visit_expr(&if_expr.true_expr, f);
            if let Some(false_expr) = &if_expr.false_expr {
                visit_expr(false_expr, f);
            }
        }
        ast::Expr::Filter(filter) => {
            if let Some(expr) = &filter.expr {
                visit_expr(expr, f);
            }
            visit_args(&filter.args, f);
        }
        ast::Expr::Test(test) => {
            visit_expr(&test.expr, f);
            visit_args(&test.args, f);
        }
        ast::Expr::GetAttr(attr) => visit_expr(&attr.expr, f),
        ast::Expr::GetItem(item) => {
            visit_expr(&item.expr, f);
            visit_expr(&item.subscript_expr, f);
        }
        ast::Expr::Call(call) => visit_call(call, f),
        ast::Expr::List(list) => {
            for item in &list.items {
                visit_expr(item, f);
            }
        }
        ast::Expr::Map(map) => {
            for (key, value) in map.keys.iter().zip(&map.values) {
                visit_expr(key, f);
                visit_expr(value, f);
            }
        }
    }
}
