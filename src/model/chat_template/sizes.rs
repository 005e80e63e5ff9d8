//! Sizes one operation of a render may ask for.
//!
//! A few of minijinja's operations make a value whose size an argument sets, and allocate
//! it at once: a list repeated (`[0] * 10**12` is lazy, but every filter or slice that
//! collects it reserves room for all its items first) or chained, `batch` and `slice` (a
//! list of `count` slots), `indent` (`width` spaces a line), the widths and precisions of
//! `format` and `str.format` (`"%999999999999d"`), and `tojson`'s indent. An allocation that
//! large fails, and a failed allocation aborts the process. Others grow their result a
//! piece at a time to a size their arguments set: `replace` and `join` (filters and string
//! methods). Nothing of the fuel bounds any of them, since each is one instruction.
//!
//! So these are checked before they run, against sizes no chat template comes near: a list
//! of [`MAX_ITEMS`] items, text of [`MAX_OUTPUT_BYTES`] (what a whole render may print).
//! Multiplication is rewritten before the template is compiled: every `a * b` becomes
//! `(a)|__times(b)`, which checks the size of a repeated list or string, then multiplies
//! as minijinja does. The rewrite adds characters inside lines (no new lines), so errors
//! still name the line.
//!
//! Two panics of minijinja 2.24.0 are kept from being reached the same way: a format
//! string's key (`%(key)s`, `{0[key]}`) of other characters than ASCII is refused, and every
//! slice with a step becomes `(x)|__slice(a, b, c)`, which gives a backwards slice whose stop
//! lies past its start its empty result itself (minijinja sizes it with a subtraction that
//! wraps: harmless in a release build, a panic with the fuzz targets' overflow checks).
//!
//! What stays unchecked is memory or time grown over many steps or through nesting (a
//! string doubled in a loop, a list concatenated to itself, a list of a million lists of a
//! million items, printed): a render in the node runs in a worker process with a memory
//! limit and a deadline (see `template_worker`), which ends it with a clear error whatever
//! it does.

use std::sync::LazyLock;

use minijinja::machinery::{Token, ast};
use minijinja::value::{Kwargs, Rest, StringInput, ValueKind};
use minijinja::{Environment, Error, ErrorKind, Expression, State, Value, context};

use super::limits::MAX_OUTPUT_BYTES;

/// The most items a list made by repeating or chaining lists may hold, that `join` joins,
/// and the most slots `batch` and `slice` may make (a list of them takes 24 MiB).
pub const MAX_ITEMS: usize = 1 << 20;

/// The filter every `a * b` is rewritten to.
pub const TIMES: &str = "__times";

/// The filter every slice with a step (`x[a:b:c]`) is rewritten to.
pub const SLICE: &str = "__slice";

/// minijinja's own multiplication, on a plain environment of its own (its operators are
/// not public API).
static PRODUCT: LazyLock<Expression<'static, 'static>> = LazyLock::new(|| {
    let env: &'static Environment<'static> = Box::leak(Box::new(Environment::new()));
    env.compile_expression("a * b")
        .expect("a constant expression compiles")
});

/// minijinja's own slicing, as [`PRODUCT`] is its multiplication.
static SLICED: LazyLock<Expression<'static, 'static>> = LazyLock::new(|| {
    let env: &'static Environment<'static> = Box::leak(Box::new(Environment::new()));
    env.compile_expression("x[a:b:c]")
        .expect("a constant expression compiles")
});

/// `e` made anew without the location of a helper expression, so that the template's
/// render names the template's line.
fn relocated(e: Error) -> Error {
    let detail = e
        .detail()
        .map_or_else(|| e.kind().to_string(), str::to_owned);
    Error::new(e.kind(), detail)
}

/// `value[start:stop:step]`, as minijinja slices, but for a backwards slice whose stop lies
/// past its start (`"ab"[:9:-2]`), which is empty, as in Python: minijinja 2.24.0 sizes
/// that range with a subtraction that wraps (harmlessly in a release build, a panic with
/// overflow checks, as the fuzz targets run).
pub fn slice_step(value: Value, start: Value, stop: Value, step: Value) -> Result<Value, Error> {
    let index = |v: &Value| i64::try_from(v.clone()).ok();
    let len = match value.as_str() {
        Some(text) => Some(text.chars().count()),
        None if matches!(value.kind(), ValueKind::Seq) => value.len(),
        None => None,
    };
    if let (Some(end), Some(step)) = (len, index(&step))
        && step < 0
    {
        let end = end as i64;
        let first = match (!start.is_none()).then(|| index(&start)).flatten() {
            None => (end - 1).max(0),
            Some(s) if s >= end => (end - 1).max(0),
            Some(s) if s >= 0 => s,
            Some(s) => (end + s).max(0),
        };
        let last = match (!stop.is_none()).then(|| index(&stop)).flatten() {
            None => 0,
            Some(s) if s < 0 => (end + s).max(0),
            Some(s) => s,
        };
        if last != 0 && last > first {
            return Ok(if value.as_str().is_some() {
                Value::from("")
            } else {
                Value::from(Vec::<Value>::new())
            });
        }
    }
    SLICED
        .eval(context! { x => value, a => start, b => stop, c => step })
        .map_err(relocated)
}

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
    PRODUCT.eval(context! { a => a, b => b }).map_err(relocated)
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

/// minijinja's `chain`, when the lists chained hold at most [`MAX_ITEMS`] items in all.
pub fn chain(state: &State, value: Value, others: Rest<Value>) -> Result<Value, Error> {
    let items = std::iter::once(&value)
        .chain(others.iter())
        .map(|v| v.len().unwrap_or(0))
        .fold(0usize, usize::saturating_add);
    if items > MAX_ITEMS {
        return Err(too_large(format!(
            "chain of lists holding {items} items in all: more than {MAX_ITEMS}"
        )));
    }
    minijinja::filters::chain(state, value, others)
}

/// Refuses replacing `old` by `new` in `text` when the result would be longer than
/// [`MAX_OUTPUT_BYTES`] (as the `replace` filter and `str.replace` do it).
fn check_replace(text: &str, old: &str, new: &str) -> Result<(), Error> {
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
    Ok(())
}

/// minijinja's `replace`, when its result fits in [`MAX_OUTPUT_BYTES`].
pub fn replace(
    state: &State,
    value: StringInput<'_>,
    from: StringInput<'_>,
    to: StringInput<'_>,
) -> Result<Value, Error> {
    check_replace(value.as_str(), from.as_str(), to.as_str())?;
    minijinja::filters::replace(state, value, from, to)
}

/// Refuses joining `items` with `separator` between them when the strings among them and
/// the separators come to more than [`MAX_OUTPUT_BYTES`], or they are more than
/// [`MAX_ITEMS`] (as the `join` filter and `str.join` do it).
fn check_join(items: &Value, separator: usize) -> Result<(), Error> {
    let Ok(iter) = items.try_iter() else {
        return Ok(());
    };
    let mut bytes = 0usize;
    for (i, item) in iter.enumerate() {
        if i >= MAX_ITEMS {
            return Err(too_large(format!("join of more than {MAX_ITEMS} items")));
        }
        let between = if i > 0 { separator } else { 0 };
        bytes = bytes
            .saturating_add(item.as_str().map_or(0, str::len))
            .saturating_add(between);
        if bytes > MAX_OUTPUT_BYTES {
            return Err(too_large(format!(
                "join of more than {MAX_OUTPUT_BYTES} bytes, the most a render may print"
            )));
        }
    }
    Ok(())
}

/// minijinja's `join`, when what it joins fits in [`MAX_OUTPUT_BYTES`].
pub fn join(state: &State, value: &Value, joiner: Option<StringInput<'_>>) -> Result<Value, Error> {
    check_join(value, joiner.as_ref().map_or(0, |j| j.as_str().len()))?;
    minijinja::filters::join(state, value, joiner)
}

/// minijinja's `format` (printf style), when no width or precision in the format string
/// exceeds [`MAX_OUTPUT_BYTES`].
pub fn format(state: &State, format_str: &Value, args: Rest<Value>) -> Result<Value, Error> {
    if let Some(text) = format_str.as_str() {
        check_fields(text, printf_fields(text))?;
    }
    minijinja::filters::format(state, format_str, args)
}

/// The methods Python strings, lists and maps have (minijinja-contrib's `pycompat`), with
/// `str.format`, `str.replace` and `str.join` checked as the filters are, and
/// `str.count('')` answered here (pycompat's never ends).
pub fn unknown_method(
    state: &State,
    value: &Value,
    method: &str,
    args: &[Value],
) -> Result<Value, Error> {
    if let Some(text) = value.as_str() {
        let arg = |i: usize| args.get(i).and_then(Value::as_str);
        match method {
            "format" => check_fields(text, str_format_fields(text))?,
            "replace" => {
                if let (Some(old), Some(new)) = (arg(0), arg(1)) {
                    check_replace(text, old, new)?;
                }
            }
            "join" => {
                if let Some(items) = args.first() {
                    check_join(items, text.len())?;
                }
            }
            "count" if arg(0) == Some("") => {
                if args.len() > 1 {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "str.count('') with a start or end is not supported",
                    ));
                }
                // As Python: the empty string occurs before each character and at the end.
                return Ok(Value::from(text.chars().count() + 1));
            }
            _ => {}
        }
    }
    minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
}

/// What a format string's fields hold that is checked: each field's spec (its flags, width
/// and precision) and its keys (a printf `%(key)`, a `str.format` `[index]`).
#[derive(Default)]
struct Fields<'s> {
    specs: Vec<&'s str>,
    keys: Vec<&'s str>,
}

/// Refuses a format string with a width or precision (a number in a spec) above
/// [`MAX_OUTPUT_BYTES`], or with a key holding other characters than ASCII: minijinja
/// 2.24.0 reads a key a byte at a time and panics on a character of more than one byte.
fn check_fields(text: &str, fields: Fields<'_>) -> Result<(), Error> {
    let quoted = || format!("{:?}", text.chars().take(80).collect::<String>());
    if let Some(key) = fields.keys.iter().find(|key| !key.is_ascii()) {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            format!(
                "the format string {} has a key with characters other than ASCII ({key:?}), \
                 which the formatter cannot read",
                quoted()
            ),
        ));
    }
    for spec in &fields.specs {
        for digits in spec.split(|c: char| !c.is_ascii_digit()) {
            if digits.is_empty() {
                continue;
            }
            if digits.parse::<usize>().is_ok_and(|n| n <= MAX_OUTPUT_BYTES) {
                continue;
            }
            return Err(too_large(format!(
                "the format string {} asks for a width or precision of {digits}, more than \
                 the {MAX_OUTPUT_BYTES} bytes a render may print",
                quoted()
            )));
        }
    }
    Ok(())
}

/// The fields of a printf-style format string: each conversion's mapping key (`%(key)`,
/// to its closing parenthesis or the end) and its spec, from after the key to its
/// conversion letter; `%%` is a percent sign.
fn printf_fields(text: &str) -> Fields<'_> {
    let mut fields = Fields::default();
    let mut rest = text;
    while let Some(at) = rest.find('%') {
        rest = &rest[at + 1..];
        if let Some(after) = rest.strip_prefix('%') {
            rest = after;
            continue;
        }
        if let Some(key) = rest.strip_prefix('(') {
            // The key runs to its closing parenthesis (minijinja takes no nesting).
            let end = key.find(')').unwrap_or(key.len());
            fields.keys.push(&key[..end]);
            rest = key.get(end + 1..).unwrap_or("");
        }
        let end = rest
            .find(|c: char| c.is_ascii_alphabetic() || c == '%')
            .unwrap_or(rest.len());
        fields.specs.push(&rest[..end]);
        rest = &rest[end..];
    }
    fields
}

/// The fields of a `str.format` string: the `[index]` keys of each field name (an index
/// runs to its `]`, or the end, and may hold `}` or `:`) and the spec after the name's `:`
/// up to the closing `}`; `{{` and `}}` are braces.
fn str_format_fields(text: &str) -> Fields<'_> {
    let mut fields = Fields::default();
    let mut rest = text;
    while let Some(at) = rest.find('{') {
        rest = &rest[at + 1..];
        if let Some(after) = rest.strip_prefix('{') {
            rest = after;
            continue;
        }
        // The field name, with its `[...]` indexes whole.
        let mut name_end = rest.len();
        let mut index_start = None;
        for (i, c) in rest.char_indices() {
            match (c, index_start) {
                ('[', None) => index_start = Some(i + 1),
                (']', Some(start)) => {
                    fields.keys.push(&rest[start..i]);
                    index_start = None;
                }
                (':' | '}', None) => {
                    name_end = i;
                    break;
                }
                _ => {}
            }
        }
        if let Some(start) = index_start {
            fields.keys.push(&rest[start..]);
        }
        rest = &rest[name_end..];
        if let Some(spec) = rest.strip_prefix(':') {
            let end = spec.find('}').unwrap_or(spec.len());
            fields.specs.push(&spec[..end]);
            rest = &spec[end..];
        }
    }
    fields
}

/// `source` with every `a * b` rewritten to `(a)|__times(b)`; an error for a template that
/// does not parse. No parentheses are needed around the whole: what follows a product in
/// the source is an operator that binds less tightly than a filter (a filter, test,
/// attribute, index or call after `b` belongs to `b`).
pub fn guard(source: &str, name: &str) -> Result<String, String> {
    let parse = |source| super::parse_source(source, name);
    let template = parse(source)?;
    let mut products = Vec::new();
    let mut written = 0;
    visit_stmt(&template, &mut |expr| {
        if let ast::Expr::Filter(filter) = expr
            && filter.name == TIMES
        {
            written += 1;
        }
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
    let tokens = super::source_tokens(source)?;
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
    if left != 0 || next != products.len() || filters != written + products.len() {
        return Err(cannot());
    }
    Ok(rewritten)
}

/// `source` with every slice that has a step, `x[a:b:c]`, rewritten to
/// `(x)|__slice(a, b, c)` (a part left out is `none`), but those inside another such slice,
/// which stay as they are; an error for a template that does not parse. The parts are
/// read from the tokens: what lies between the brackets and the colons at their depth.
pub fn guard_slices(source: &str, name: &str) -> Result<String, String> {
    let parse = |source| super::parse_source(source, name);
    let template = parse(source)?;
    let stepped =
        |expr: &ast::Expr<'_>| matches!(expr, ast::Expr::Slice(slice) if slice.step.is_some());
    let mut slices = Vec::new();
    let mut written = 0;
    visit_stmt(&template, &mut |expr| match expr {
        ast::Expr::Slice(slice) if slice.step.is_some() => slices.push((
            (slice.span().start_offset as usize).min(chain_start(&slice.expr)),
            slice.expr.span().end_offset as usize,
            slice.span().end_offset as usize,
        )),
        ast::Expr::Filter(filter) if filter.name == SLICE => written += 1,
        _ => {}
    });
    if slices.is_empty() {
        return Ok(source.to_string());
    }
    let cannot = || "chat template: cannot check the slices it takes".to_string();
    let tokens = super::source_tokens(source)?;
    slices.sort_by_key(|&(start, _, end)| (start, std::cmp::Reverse(end)));
    let found = slices.len();
    let mut rewritten = String::with_capacity(source.len() + slices.len() * 32);
    let (mut copied, mut count) = (0, 0);
    for (start, value_end, end) in slices {
        if start < copied {
            continue; // inside a slice already rewritten: copied as it is
        }
        // The opening bracket after the sliced value, then its parts at depth 0.
        let first = tokens.partition_point(|(_, span)| (span.start_offset as usize) < value_end);
        let mut depth = 0usize;
        let mut bounds = Vec::new();
        let mut open = None;
        for (token, span) in &tokens[first..] {
            let (at, after) = (span.start_offset as usize, span.end_offset as usize);
            match token {
                // What closes around the value (`(x)[...]`) comes before its bracket.
                _ if open.is_none() && !matches!(token, Token::BracketOpen) => {}
                Token::BracketOpen if open.is_none() => {
                    open = Some(after);
                    bounds.push(after);
                }
                Token::BracketOpen | Token::ParenOpen | Token::BraceOpen => depth += 1,
                Token::BracketClose if depth == 0 && open.is_some() => {
                    bounds.push(at);
                    break;
                }
                Token::BracketClose | Token::ParenClose | Token::BraceClose => {
                    depth = depth.checked_sub(1).ok_or_else(cannot)?
                }
                Token::Colon if depth == 0 && open.is_some() => {
                    bounds.push(at);
                    bounds.push(after);
                }
                _ => {}
            }
        }
        // [a, :, b, :, c]: six bounds, the last the closing bracket where the node ends.
        let (Some(open), 6) = (open, bounds.len()) else {
            return Err(cannot());
        };
        let part = |i: usize| {
            let text = source
                .get(bounds[2 * i]..bounds[2 * i + 1])
                .unwrap_or("")
                .trim();
            if text.is_empty() { "none" } else { text }
        };
        let (Some(before), Some(value)) = (source.get(copied..start), source.get(start..open - 1))
        else {
            return Err(cannot());
        };
        if source.get(bounds[5]..end) != Some("]") {
            return Err(cannot());
        }
        rewritten.push_str(before);
        rewritten.push('(');
        rewritten.push_str(value);
        rewritten.push_str(&format!(")|{SLICE}({}, {}, {})", part(0), part(1), part(2)));
        copied = end;
        count += 1;
    }
    rewritten.push_str(source.get(copied..).ok_or_else(cannot)?);
    // The rewritten template must parse, with the filter in place of each slice rewritten.
    let checked = parse(&rewritten)?;
    let (mut left, mut filters) = (0, 0);
    visit_stmt(&checked, &mut |expr| match expr {
        ast::Expr::Filter(filter) if filter.name == SLICE => filters += 1,
        expr if stepped(expr) => left += 1,
        _ => {}
    });
    if filters != written + count || left + count != found {
        return Err(cannot());
    }
    Ok(rewritten)
}

/// Where the value a postfix chain (`x.a[0](1)[::-1]`) applies to starts: the span of a
/// postfix node after the first starts at the previous one's bracket, not at the value.
fn chain_start(expr: &ast::Expr<'_>) -> usize {
    let inner = match expr {
        ast::Expr::Slice(slice) => Some(&slice.expr),
        ast::Expr::GetItem(item) => Some(&item.expr),
        ast::Expr::GetAttr(attr) => Some(&attr.expr),
        ast::Expr::Call(call) => Some(&call.expr),
        _ => None,
    };
    let own = expr.span().start_offset as usize;
    inner.map_or(own, |inner| own.min(chain_start(inner)))
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
        out.push('(');
        emit(source, products, next, product.start, operator_start, out)?;
        out.push_str(")|");
        out.push_str(TIMES);
        out.push('(');
        emit(source, products, next, operator_end, product.end, out)?;
        out.push(')');
        copied = product.end;
    }
    out.push_str(source.get(copied..to)?);
    Some(())
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
