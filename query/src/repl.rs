//! The SQL prompt and the printing of results behind `custody query` (the binary parses the
//! command line and opens the verified session): statements end with `;`, `\d` lists tables,
//! `\d <table>` describes one, `\q` quits; line editing and history on a terminal
//! (`rustyline`, after datafusion-cli), the same commands from a pipe. Results print as a table,
//! CSV or JSON lines.

use std::io::{BufRead, Write};
use std::path::PathBuf;

use datafusion::arrow::error::ArrowError;
use datafusion::arrow::record_batch::RecordBatch;
use datafusion::arrow::util::display::{ArrayFormatter, FormatOptions};
use datafusion::arrow::util::pretty::pretty_format_batches;
use datafusion::prelude::SessionContext;

use crate::QueryError;

/// How results are printed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Table,
    Csv,
    Json,
}

/// Why the prompt or a printing stopped.
#[derive(Debug, thiserror::Error)]
pub enum ReplError {
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Arrow(#[from] ArrowError),
    #[error(transparent)]
    Query(#[from] QueryError),
    #[error("line editing: {0}")]
    Readline(#[from] rustyline::error::ReadlineError),
    #[error("explained_by_crash is not text")]
    NotText,
}

/// Shown while a statement runs (the binary's spinner): called at its start, and the returned
/// function at its end.
pub type Busy<'a> = &'a dyn Fn() -> Box<dyn FnOnce()>;

/// Run `sql` (statements as for [`crate::run_script`]) and print each statement's result.
pub async fn run_and_print(
    ctx: &SessionContext,
    sql: &str,
    format: Format,
    busy: Busy<'_>,
) -> Result<(), ReplError> {
    let done = busy();
    let results = crate::run_script(ctx, sql).await;
    done();
    for batches in results? {
        print(&batches, format)?;
    }
    Ok(())
}

/// One statement's batches on stdout.
pub fn print(batches: &[RecordBatch], format: Format) -> Result<(), ReplError> {
    let mut out = std::io::stdout().lock();
    if batches.iter().all(|b| b.num_rows() == 0) && matches!(format, Format::Table) {
        writeln!(out, "(0 rows)")?;
        return Ok(());
    }
    match format {
        Format::Table => writeln!(out, "{}", pretty_format_batches(batches)?)?,
        Format::Csv | Format::Json => {
            let Some(schema) = batches.first().map(|b| b.schema()) else {
                return Ok(());
            };
            let names: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
            if matches!(format, Format::Csv) {
                writeln!(out, "{}", names.join(","))?;
            }
            let opts = FormatOptions::default().with_null("");
            for b in batches {
                let fmts: Vec<ArrayFormatter<'_>> = b
                    .columns()
                    .iter()
                    .map(|c| ArrayFormatter::try_new(c.as_ref(), &opts))
                    .collect::<Result<_, ArrowError>>()?;
                for row in 0..b.num_rows() {
                    let vals: Vec<String> = fmts.iter().map(|f| f.value(row).to_string()).collect();
                    if matches!(format, Format::Csv) {
                        let esc: Vec<String> = vals
                            .iter()
                            .map(|v| {
                                if v.contains([',', '"', '\n']) {
                                    format!("\"{}\"", v.replace('"', "\"\""))
                                } else {
                                    v.clone()
                                }
                            })
                            .collect();
                        writeln!(out, "{}", esc.join(","))?;
                    } else {
                        let obj: serde_json::Map<String, serde_json::Value> = names
                            .iter()
                            .zip(&vals)
                            .zip(b.columns())
                            .map(|((n, v), c)| {
                                let val = if c.data_type().is_numeric() {
                                    v.parse::<serde_json::Number>()
                                        .map(serde_json::Value::Number)
                                        .unwrap_or_else(|_| serde_json::Value::String(v.clone()))
                                } else {
                                    serde_json::Value::String(v.clone())
                                };
                                ((*n).to_owned(), val)
                            })
                            .collect();
                        writeln!(out, "{}", serde_json::Value::Object(obj))?;
                    }
                }
            }
        }
    }
    Ok(())
}

/// What one line typed at the prompt asks for.
enum Line {
    Quit,
    /// A complete statement (without its `;`) or a backslash command's SQL.
    Run(String),
    /// Part of a statement: keep reading.
    More,
    Help,
}

/// The prompt's line discipline, shared by the terminal and the piped paths: `\q`, `\d`,
/// `\d table`; SQL accumulates until a line ends with `;`.
#[derive(Default)]
struct Prompt {
    buf: String,
}

impl Prompt {
    fn feed(&mut self, line: &str) -> Line {
        let t = line.trim();
        if self.buf.is_empty() && t.starts_with('\\') {
            return match t.split_whitespace().collect::<Vec<_>>()[..] {
                ["\\q"] => Line::Quit,
                ["\\d"] => Line::Run("SHOW TABLES".into()),
                ["\\d", table] => Line::Run(format!("DESCRIBE {table}")),
                _ => Line::Help,
            };
        }
        self.buf.push_str(line);
        self.buf.push('\n');
        if !t.ends_with(';') {
            return Line::More;
        }
        let stmt = self.buf.trim().trim_end_matches(';').to_owned();
        self.buf.clear();
        Line::Run(stmt)
    }

    fn prompt(&self) -> &'static str {
        if self.buf.is_empty() {
            "custody> "
        } else {
            "      -> "
        }
    }
}

/// Where the prompt keeps its history (after datafusion-cli's `~/.datafusion_history`).
pub fn history_path() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("CUSTODY_HISTORY") {
        return Some(PathBuf::from(p));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".custody_history"))
}

/// Most entries kept in the history file.
const HISTORY_MAX: usize = 1000;

pub async fn interactive(
    ctx: &SessionContext,
    format: Format,
    busy: Busy<'_>,
) -> Result<(), ReplError> {
    use std::io::IsTerminal;
    if !std::io::stdin().is_terminal() {
        return interactive_piped(ctx, format, busy).await;
    }
    // A terminal: line editing and history (arrow keys, Ctrl-R), saved across sessions.
    let config = rustyline::Config::builder()
        .max_history_size(HISTORY_MAX)?
        .auto_add_history(false)
        .build();
    let mut rl = rustyline::DefaultEditor::with_config(config)?;
    let hist = history_path();
    if let Some(h) = &hist {
        let _ = rl.load_history(h); // absent on first use
    }
    eprintln!(
        "custody: SQL ends with ;  \\d tables, \\d <table> columns, \\q quit  (history: {})",
        hist.as_deref()
            .map_or_else(|| "off".into(), |h| h.display().to_string())
    );
    let mut p = Prompt::default();
    loop {
        let line = match rl.readline(p.prompt()) {
            Ok(l) => l,
            Err(rustyline::error::ReadlineError::Interrupted) => {
                p = Prompt::default(); // Ctrl-C drops the statement being typed
                continue;
            }
            Err(rustyline::error::ReadlineError::Eof) => break,
            Err(e) => return Err(e.into()),
        };
        match p.feed(&line) {
            Line::Quit => break,
            Line::More => {}
            Line::Help => eprintln!("commands: \\d, \\d <table>, \\q; SQL ends with ;"),
            Line::Run(sql) => {
                // Whether the entry was new (a repeat is not added twice) does not matter here.
                let _ = rl.add_history_entry(if line.trim_start().starts_with('\\') {
                    line.trim()
                } else {
                    sql.as_str()
                });
                if let Some(h) = &hist
                    && let Err(e) = rl.save_history(h)
                {
                    eprintln!("warning: cannot save history to {}: {e}", h.display());
                }
                if let Err(e) = run_and_print(ctx, &sql, format, busy).await {
                    eprintln!("error: {e:#}");
                }
            }
        }
    }
    Ok(())
}

/// Statements from a pipe (scripts, tests): the same commands, no line editing or history.
async fn interactive_piped(
    ctx: &SessionContext,
    format: Format,
    busy: Busy<'_>,
) -> Result<(), ReplError> {
    let mut p = Prompt::default();
    for line in std::io::stdin().lock().lines() {
        match p.feed(&line?) {
            Line::Quit => break,
            Line::More => {}
            Line::Help => eprintln!("commands: \\d, \\d <table>, \\q; SQL ends with ;"),
            Line::Run(sql) => {
                if let Err(e) = run_and_print(ctx, &sql, format, busy).await {
                    eprintln!("error: {e:#}");
                }
            }
        }
    }
    Ok(())
}

/// The fleet crosscheck's rows: (disagreements, rows explained by a killed node's lost tail),
/// by its last column `explained_by_crash` (empty: not explained).
pub fn count_unexplained(results: &[Vec<RecordBatch>]) -> Result<(usize, usize), ReplError> {
    use datafusion::arrow::array::{Array, StringArray};
    use datafusion::arrow::compute::cast;
    use datafusion::arrow::datatypes::DataType;
    let (mut bad, mut explained) = (0, 0);
    for b in results.iter().flatten() {
        let Some(col) = b.columns().last() else {
            continue;
        };
        let col = cast(col, &DataType::Utf8)?;
        let Some(s) = col.as_any().downcast_ref::<StringArray>() else {
            return Err(ReplError::NotText);
        };
        for i in 0..s.len() {
            if s.is_null(i) || s.value(i).is_empty() {
                bad += 1;
            } else {
                explained += 1;
            }
        }
    }
    Ok((bad, explained))
}
