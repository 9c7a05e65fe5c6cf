//! Tables that print as markdown in the terminal and as real `<table>`s in a page, and the page:
//! one self-contained HTML file (inline CSS and SVG, nothing fetched over the network).

use super::facts::RunFacts;
use super::svg::escape;
use std::fmt::Write;

/// Rows under headers; a header carries its unit (`peak (MB)`), cells are plain text.
#[derive(Debug, Clone, Default)]
pub struct Table {
    pub caption: String,
    pub headers: Vec<String>,
    pub rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(caption: impl Into<String>, headers: &[&str]) -> Table {
        Table {
            caption: caption.into(),
            headers: headers.iter().map(|h| h.to_string()).collect(),
            rows: Vec::new(),
        }
    }

    /// A row; a figure that rounds to zero is never shown negative (`-0.00` reads as a sign error).
    pub fn row(&mut self, cells: Vec<String>) {
        let unsigned_zero = |c: String| match c.strip_prefix('-') {
            Some(rest) if rest.parse::<f64>() == Ok(0.0) => rest.to_string(),
            _ => c,
        };
        self.rows
            .push(cells.into_iter().map(unsigned_zero).collect());
    }

    /// The caption, then a markdown table (for the terminal).
    pub fn markdown(&self) -> String {
        let mut s = String::new();
        if !self.caption.is_empty() {
            let _ = writeln!(s, "{}\n", self.caption);
        }
        let _ = writeln!(s, "| {} |", self.headers.join(" | "));
        let _ = writeln!(s, "|{}", "---|".repeat(self.headers.len()));
        for r in &self.rows {
            let _ = writeln!(s, "| {} |", r.join(" | "));
        }
        s
    }

    /// An HTML table; cells that read as numbers are right-aligned.
    pub fn html(&self) -> String {
        let mut s = String::from("<div class=\"table\"><table>\n");
        if !self.caption.is_empty() {
            let _ = writeln!(s, "<caption>{}</caption>", escape(&self.caption));
        }
        s.push_str("<thead><tr>");
        for h in &self.headers {
            let _ = write!(s, "<th>{}</th>", escape(h));
        }
        s.push_str("</tr></thead>\n<tbody>\n");
        for r in &self.rows {
            s.push_str("<tr>");
            for c in r {
                let numeric = c
                    .trim_start_matches(['-', '+'])
                    .starts_with(|ch: char| ch.is_ascii_digit());
                let _ = write!(
                    s,
                    "<td{}>{}</td>",
                    if numeric { " class=\"num\"" } else { "" },
                    escape(c)
                );
            }
            s.push_str("</tr>\n");
        }
        s.push_str("</tbody></table></div>\n");
        s
    }
}

/// One part of a page: a heading, paragraphs of text, then HTML (tables, pictures).
pub struct Section {
    pub heading: String,
    pub notes: Vec<String>,
    pub body: String,
}

impl Section {
    pub fn new(heading: impl Into<String>) -> Section {
        Section {
            heading: heading.into(),
            notes: Vec::new(),
            body: String::new(),
        }
    }

    pub fn note(mut self, text: impl Into<String>) -> Section {
        self.notes.push(text.into());
        self
    }

    pub fn table(mut self, t: &Table) -> Section {
        self.body.push_str(&t.html());
        self
    }

    /// Pictures side by side where the page is wide enough.
    pub fn pictures(mut self, svgs: &[&str]) -> Section {
        self.body.push_str("<div class=\"pictures\">\n");
        for s in svgs {
            let _ = writeln!(self.body, "<figure>{s}</figure>");
        }
        self.body.push_str("</div>\n");
        self
    }

    /// A numbered list of steps; a step that numbers itself (`1. …`) keeps its own number.
    pub fn ordered(mut self, items: &[String]) -> Section {
        self.body.push_str("<ol class=\"steps\">\n");
        for i in items {
            let _ = writeln!(self.body, "<li>{}</li>", escape(i));
        }
        self.body.push_str("</ol>\n");
        self
    }

    /// A bulleted list.
    pub fn list(mut self, items: &[String]) -> Section {
        self.body.push_str("<ul>\n");
        for i in items {
            let _ = writeln!(self.body, "<li>{}</li>", escape(i));
        }
        self.body.push_str("</ul>\n");
        self
    }
}

/// Pages fit any screen from 800 px up: headings wrap anywhere, pictures scale with their
/// viewBox, tables scroll inside their own box; nothing widens the page.
const STYLE: &str = "body{font-family:sans-serif;margin:20px;max-width:1240px;color:#222}\
h1{font-size:22px;overflow-wrap:anywhere}h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd}\
dl.facts{display:flex;flex-wrap:wrap;gap:6px 24px;margin:0 0 12px;font-size:13px}\
dl.facts div{max-width:100%}dl.facts dt{color:#666;font-size:11px}dl.facts dd{margin:0;overflow-wrap:anywhere}\
.table{max-width:100%;overflow-x:auto}\
table{border-collapse:collapse;font-size:12px;margin:8px 0 16px}\
caption{text-align:left;font-weight:bold;padding:4px 0}\
th{background:#f2f2f2;text-align:left;vertical-align:bottom;max-width:9em}\
th,td{border:1px solid #ddd;padding:3px 6px}td{overflow-wrap:anywhere;min-width:3em}td.num{text-align:right;white-space:nowrap}\
tbody tr:nth-child(even){background:#fafafa}\
.pictures{display:flex;flex-wrap:wrap;gap:16px;align-items:flex-start}\
figure{margin:0;max-width:100%}svg{max-width:100%;height:auto}\
p.note{margin:6px 0;max-width:60em;overflow-wrap:anywhere}li{overflow-wrap:anywhere}ol.steps{list-style:none;padding-left:8px}ol.steps li{margin:4px 0}";

/// The page: a title, what was run, then each section in order.
pub fn page(title: &str, facts: &RunFacts, sections: &[Section]) -> String {
    let mut s = format!(
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width\"><title>{0}</title>\
         <style>{STYLE}</style></head><body>\n<h1>{0}</h1>\n",
        escape(title)
    );
    s.push_str(&facts.html());
    for sec in sections {
        let _ = writeln!(s, "<h2>{}</h2>", escape(&sec.heading));
        for n in &sec.notes {
            let _ = writeln!(s, "<p class=\"note\">{}</p>", escape(n));
        }
        s.push_str(&sec.body);
    }
    s.push_str("</body></html>\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_table_is_markdown_for_the_terminal_and_html_for_the_page() {
        let mut t = Table::new("memory", &["device", "peak (MB)"]);
        t.row(vec!["0".into(), "31.20".into()]);
        t.row(vec!["-0.00".into(), "-1.50".into()]);
        assert_eq!(t.rows[1], ["0.00", "-1.50"]);
        t.rows.pop();
        assert_eq!(
            t.markdown(),
            "memory\n\n| device | peak (MB) |\n|---|---|\n| 0 | 31.20 |\n"
        );
        let h = t.html();
        assert!(h.contains("<th>peak (MB)</th>") && h.contains("<td class=\"num\">31.20</td>"));
        let p = page(
            "a <b>",
            &RunFacts::default(),
            &[Section::new("s").table(&t)],
        );
        assert!(p.contains("<title>a &lt;b&gt;</title>") && !p.contains("http"));
    }
}
