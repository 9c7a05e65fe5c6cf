// Measures a rendered report in the browser and writes what the checks need into the page as
// JSON (a pre element with id geometry), which `chromium --dump-dom` then prints.
(function () {
  const box = (e) => {
    const r = e.getBoundingClientRect();
    return { x: r.left, y: r.top, w: r.width, h: r.height };
  };
  const svgs = [...document.querySelectorAll('svg')].map((svg, i) => {
    const bars = {};
    svg.querySelectorAll('rect.term').forEach((r) => {
      const d = r.getAttribute('data-device');
      const b = box(r);
      const bar = bars[d] || (bars[d] = { top: Infinity, bottom: -Infinity, terms: 0 });
      if (b.h > 0) {
        bar.top = Math.min(bar.top, b.y);
        bar.bottom = Math.max(bar.bottom, b.y + b.h);
      }
      bar.terms += 1;
    });
    const texts = [...svg.querySelectorAll('text')].map((t) => ({
      cls: t.getAttribute('class') || '',
      text: t.textContent,
      ...box(t),
    }));
    return {
      index: i,
      title: (svg.querySelector('text.title') || { textContent: '' }).textContent,
      width: box(svg).w,
      bars: Object.entries(bars).map(([device, b]) => ({
        device,
        height: b.bottom > b.top ? b.bottom - b.top : 0,
        terms: b.terms,
      })),
      texts,
      limits: [...svg.querySelectorAll('line.limit')].map((l) => l.getAttribute('data-limit')),
      actions: svg.querySelectorAll('rect.action').length,
    };
  });
  const out = {
    viewport: document.documentElement.clientWidth,
    scroll_width: document.documentElement.scrollWidth,
    tables: [...document.querySelectorAll('table')].map((t) => ({
      rows: t.querySelectorAll('tbody tr').length,
      headers: [...t.querySelectorAll('th')].map((h) => h.textContent),
      right: box(t).x + box(t).w,
    })),
    pre: document.querySelectorAll('pre').length,
    svgs,
  };
  const pre = document.createElement('pre');
  pre.id = 'geometry';
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
})();
