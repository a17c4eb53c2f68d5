//! Text for a terminal: tables whose columns wrap, and paragraphs, so that no line is wider than
//! the width the report is printed at ([`width`]).

use std::fmt::Write as _;
use std::io::IsTerminal;

use crate::verdict::Check;

/// The width of lines when standard output is not a terminal (a file, a pipe).
pub const DEFAULT_WIDTH: usize = 100;
/// The narrowest width the report wraps to, however narrow the terminal.
pub const MIN_WIDTH: usize = 40;
/// The narrowest a table column is squeezed to before a line is allowed to run over.
const MIN_COLUMN: usize = 6;

/// The width to print at: the terminal's when standard output is one (at least [`MIN_WIDTH`]),
/// else [`DEFAULT_WIDTH`].
pub fn width() -> usize {
    let stdout = std::io::stdout();
    if !stdout.is_terminal() {
        return DEFAULT_WIDTH;
    }
    match rustix::termios::tcgetwinsize(&stdout) {
        Ok(size) if size.ws_col > 0 => usize::from(size.ws_col).max(MIN_WIDTH),
        _ => DEFAULT_WIDTH,
    }
}

/// Bytes in GiB.
pub fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

/// `text` cut into lines of at most `width` characters, at spaces where it can be (a word
/// longer than a line is cut inside).
pub fn wrap(text: &str, width: usize) -> Vec<String> {
    let width = width.max(1);
    let mut lines = Vec::new();
    let mut line = String::new();
    for word in text.split(' ').filter(|w| !w.is_empty()) {
        let mut word: Vec<char> = word.chars().collect();
        let used = line.chars().count();
        if used > 0 && used + 1 + word.len() <= width {
            line.push(' ');
            line.extend(&word);
            continue;
        }
        if used > 0 {
            lines.push(std::mem::take(&mut line));
        }
        while word.len() > width {
            lines.push(word.drain(..width).collect());
        }
        line.extend(&word);
    }
    if !line.is_empty() || lines.is_empty() {
        lines.push(line);
    }
    lines
}

/// A paragraph: `first` starts the first line, `indent` spaces each of the others, all within
/// `width`.
pub fn paragraph(first: &str, text: &str, indent: usize, width: usize) -> String {
    let lead = first.chars().count();
    let mut out = String::new();
    // Wrapped at the narrower of the two leads, so every line fits.
    for (i, line) in wrap(text, width.saturating_sub(lead.max(indent))).iter().enumerate() {
        if i == 0 {
            out += first;
        } else {
            out.extend(std::iter::repeat_n(' ', indent));
        }
        out += line;
        out.push('\n');
    }
    out
}

/// Checks as a table: verdict, check, value.
pub fn checks_table(checks: &[Check], width: usize) -> String {
    table(
        &["verdict", "check", "found"],
        checks.iter().map(|c| vec![c.verdict.label().to_string(), c.name.clone(), c.value.clone()]),
        width,
    )
}

/// Left-aligned columns, two spaces apart, indented by two, with a header row. Where the
/// table would be wider than `width`, the widest columns are narrowed and their cells wrap
/// onto further lines.
pub fn table(headers: &[&str], rows: impl IntoIterator<Item = Vec<String>>, width: usize) -> String {
    let header: Vec<String> = headers.iter().map(|h| h.to_string()).collect();
    let rows: Vec<Vec<String>> = std::iter::once(header).chain(rows).collect();
    let mut widths: Vec<usize> = vec![0; headers.len()];
    for row in &rows {
        for (column, cell) in widths.iter_mut().zip(row) {
            *column = (*column).max(cell.chars().count());
        }
    }
    let line_width = |widths: &[usize]| 2 + widths.iter().sum::<usize>() + 2 * widths.len().saturating_sub(1);
    while line_width(&widths) > width {
        let (widest, &now) = widths.iter().enumerate().max_by_key(|&(_, w)| *w).expect("a table has columns");
        if now <= MIN_COLUMN {
            break;
        }
        let excess = line_width(&widths) - width;
        // The widest column gives what is too much, but not below the next widest, so that
        // the narrowing is shared among the wide columns.
        let next = widths.iter().enumerate().filter(|&(i, _)| i != widest).map(|(_, &w)| w).max().unwrap_or(0);
        widths[widest] = (now - excess).max(next.min(now - 1)).max(MIN_COLUMN);
    }
    let mut out = String::new();
    for row in &rows {
        let cells: Vec<Vec<String>> = row.iter().zip(&widths).map(|(cell, &w)| wrap(cell, w)).collect();
        let height = cells.iter().map(Vec::len).max().unwrap_or(1);
        for i in 0..height {
            let mut line = String::from(" ");
            for (cell, width) in cells.iter().zip(&widths) {
                let part = cell.get(i).map_or("", String::as_str);
                let _ = write!(line, " {part:<width$} ");
            }
            out += line.trim_end();
            out.push('\n');
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_line_up() {
        let text = table(&["a", "long header"], [vec!["wide cell".into(), "x".into()]], DEFAULT_WIDTH);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0].find("long header"), lines[1].find('x'));
    }

    #[test]
    fn a_wide_cell_wraps_within_its_column() {
        let long = "word ".repeat(200);
        let text = table(&["verdict", "check", "found"], [vec!["ok".into(), "NCCL".into(), long.clone()]], 60);
        assert!(text.lines().all(|l| l.chars().count() <= 60), "{text}");
        let column = text.lines().next().unwrap().find("found").unwrap();
        for line in text.lines().skip(1) {
            assert_eq!(line.find("word"), Some(column), "continuation lines stay in their column: {line:?}");
        }
        assert_eq!(text.matches("word").count(), 200, "nothing is lost");
    }

    #[test]
    fn words_longer_than_a_line_are_cut() {
        let lines = wrap(&format!("a {} b", "x".repeat(25)), 10);
        assert!(lines.iter().all(|l| l.chars().count() <= 10), "{lines:?}");
        assert_eq!(lines.concat().replace(' ', ""), format!("a{}b", "x".repeat(25)));
        assert_eq!(wrap("", 10), [""]);
    }

    #[test]
    fn paragraphs_hang_their_indent() {
        let text = paragraph("  1. ", &"fix it ".repeat(30), 5, 40);
        assert!(text.starts_with("  1. fix it"));
        assert!(text.lines().skip(1).all(|l| l.starts_with("     f") && l.chars().count() <= 40), "{text}");
    }
}
