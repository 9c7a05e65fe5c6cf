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
      headroom: [...svg.querySelectorAll('rect.headroom')].map((l) => l.getAttribute('data-limit')),
      actions: [...svg.querySelectorAll('rect.action')].map((r) => ({
        row: r.getAttribute('data-row'),
        kind: r.getAttribute('data-kind'),
        device: r.getAttribute('data-device'),
        width: box(r).w,
      })),
      // What each colour means: legend swatches, and the marks that carry their meaning.
      meanings: [
        ...[...svg.querySelectorAll('rect.swatch')].map((r) => [r.getAttribute('fill'), r.getAttribute('data-meaning')]),
        ...[...svg.querySelectorAll('line.limit')].map((l) => [l.getAttribute('stroke'), l.getAttribute('data-limit')]),
        ...[...svg.querySelectorAll('polyline.series')].map((l) => [l.getAttribute('stroke'), l.getAttribute('data-series')]),
        ...[...svg.querySelectorAll('polyline.live')].map((l) => [l.getAttribute('stroke'), 'live memory']),
        ...[...svg.querySelectorAll('circle.peak')].map((l) => [l.getAttribute('fill'), 'peak']),
        ...[...svg.querySelectorAll('rect.sent')].map((l) => [l.getAttribute('fill'), 'bytes sent']),
      ],
      // Colours of marks explained by this chart's legend.
      legend_colours: [...svg.querySelectorAll('rect.swatch')].map((r) => r.getAttribute('fill')),
      marked_colours: [...svg.querySelectorAll('rect.term, rect.action, rect.device[data-stage]')].map((r) => r.getAttribute('fill')),
      // Anything drawn from data: bars, boxes, lines, devices.
      marks: svg.querySelectorAll('rect.term, rect.action, rect.sent, rect.device, polyline, circle').length,
    };
  });
  const facts = document.querySelector('dl.facts');
  const out = {
    viewport: document.documentElement.clientWidth,
    scroll_width: document.documentElement.scrollWidth,
    tables: [...document.querySelectorAll('table')].map((t) => ({
      rows: t.querySelectorAll('tbody tr').length,
      headers: [...t.querySelectorAll('th')].map((h) => h.textContent),
      // A wide table scrolls inside its own box: that box must fit the page.
      right: box(t.closest('.table') || t).x + box(t.closest('.table') || t).w,
    })),
    pre: document.querySelectorAll('pre').length,
    facts: facts ? { text: facts.textContent, bottom: box(facts).y + box(facts).h } : null,
    viewport_height: document.documentElement.clientHeight,
    svgs,
  };
  const pre = document.createElement('pre');
  pre.id = 'geometry';
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
})();
