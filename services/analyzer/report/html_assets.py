"""The static style and script of ``report.html``, inlined into the page
(nothing is fetched). The script only reads the page it is in: it sorts and
filters the node table; no summary string ever enters it.
"""

CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0 auto;max-width:1400px;
padding:16px 24px;color:#222;background:#fafafa}
h1{margin:0 0 4px;font-size:22px}h2{margin:28px 0 8px;font-size:18px;border-bottom:1px solid #ddd}
.muted{color:#777}.meta{color:#555;margin:0 0 12px}
.verdict{padding:14px 18px;border-radius:6px;font-size:17px;font-weight:600}
.verdict.fail{background:#fdecea;border-left:6px solid #d32f2f}
.verdict.pass{background:#e8f5e9;border-left:6px solid #2e7d32}
.verdict.noanswer{background:#fff8e1;border-left:6px solid #ef6c00}
.coverage{margin:6px 0 0;font-weight:400;font-size:14px}
.cards{display:flex;gap:16px;flex-wrap:wrap}
.card{flex:1 1 420px;background:#fff;border:1px solid #ddd;border-radius:6px;padding:10px 14px}
.card h3{margin:0 0 4px;font-size:15px}
.card .name{font-family:ui-monospace,monospace;font-size:15px;word-break:break-all;margin:0 0 6px}
table.kv th{text-align:left;font-weight:normal;color:#555;padding-right:12px;vertical-align:top}
table.kv td{word-break:break-all}
.diag{background:#fff8e1;border-left:5px solid #f9a825;padding:8px 14px;margin:8px 0}
.scroll{overflow-x:auto}
/* the node table scrolls inside the window, both ways: its header and first two columns stay */
#table .scroll{overflow:auto;max-height:80vh;max-width:100%}
#nodes th:nth-child(-n+2),#nodes td:nth-child(-n+2){position:sticky;z-index:1;background:#fff}
#nodes th:nth-child(1),#nodes td:nth-child(1){left:0;box-sizing:border-box;width:4.5em;min-width:4.5em;max-width:4.5em}
#nodes th:nth-child(2),#nodes td:nth-child(2){left:4.5em}
#nodes th:nth-child(-n+2){z-index:3}
table.grid{border-collapse:collapse;background:#fff;font-size:13px}
table.grid th,table.grid td{border:1px solid #ddd;padding:3px 7px;text-align:left;vertical-align:top}
#nodes td{white-space:nowrap}#nodes td.wrap{white-space:normal;min-width:160px;max-width:420px;overflow-wrap:anywhere}
#verdicts td{max-width:520px;overflow-wrap:anywhere}
#nodes th{cursor:pointer;user-select:none;background:#f0f0f0;position:sticky;top:0;white-space:nowrap;z-index:2}
#nodes th:nth-child(-n+2){background:#f0f0f0}
#nodes th[aria-sort=ascending]::after{content:" ▲"}#nodes th[aria-sort=descending]::after{content:" ▼"}
#nodes tr.fail td{background:#fff0f0}#nodes tr.first td{background:#ffd6d6;font-weight:600}
#nodes tr.input td{font-style:italic}
body.only-failing #nodes tr.pass{display:none}
.badge{padding:1px 6px;border-radius:3px;color:#fff;white-space:nowrap}
.badge.comp{background:#c62828}.badge.acc{background:#ef6c00}
.plots .row{display:flex;flex-wrap:wrap;gap:10px}
figure{margin:0;flex:1 1 300px;max-width:460px}figcaption{font-size:12px;color:#555;overflow-wrap:anywhere}
figure img{width:100%;height:auto;border:1px solid #ddd;background:#fff;cursor:zoom-in}
figure.big{flex-basis:100%}figure.big img{width:auto;max-width:100%;cursor:zoom-out}
svg .ax{font-size:11px;fill:#444}svg .ax.rel{fill:#d62728}svg .ax.cos{fill:#1f77b4}
.legend .sw{display:inline-block;width:18px;height:3px;vertical-align:middle;margin:0 4px 0 12px}
.sw.rel{background:#d62728}.sw.cos{background:#1f77b4}.sw.first{border-top:2px dashed #d00;height:0}
code{font-family:ui-monospace,monospace;word-break:break-all}
footer{margin:32px 0 8px;color:#888;font-size:12px}
"""

# No summary string ever enters this script: it reads the table it sorts.
SCRIPT = r"""
(function(){
  var table=document.getElementById('nodes');
  function apply(th,dir){
    var key=th.getAttribute('data-key'),num=th.getAttribute('data-type')==='num';
    var col=Array.prototype.indexOf.call(th.parentNode.children,th);
    var body=table.tBodies[0],rows=Array.prototype.slice.call(body.rows);
    rows.sort(function(a,b){
      var x=a.cells[col].getAttribute('data-v'),y=b.cells[col].getAttribute('data-v'),c;
      if(num){
        var ex=(x===''),ey=(y==='');
        if(ex||ey){return ex===ey?(+a.getAttribute('data-i'))-(+b.getAttribute('data-i')):(ex?1:-1);}
        x=parseFloat(x);y=parseFloat(y);c=x<y?-1:(x>y?1:0);
      }else{c=x.localeCompare(y);}
      return c*dir||(+a.getAttribute('data-i'))-(+b.getAttribute('data-i'));
    });
    rows.forEach(function(r){body.appendChild(r);});
    Array.prototype.forEach.call(th.parentNode.children,function(h){h.setAttribute('aria-sort','none');});
    th.setAttribute('aria-sort',dir>0?'ascending':'descending');
    document.body.setAttribute('data-sorted',(dir>0?'':'-')+key);
  }
  if(table){
    Array.prototype.forEach.call(table.tHead.rows[0].cells,function(th){
      function go(){apply(th,th.getAttribute('aria-sort')==='ascending'?-1:1);}
      th.addEventListener('click',go);
      th.addEventListener('keydown',function(e){if(e.key==='Enter'||e.key===' '){e.preventDefault();go();}});
    });
  }
  Array.prototype.forEach.call(document.querySelectorAll('.plots figure img'),function(img){
    img.addEventListener('click',function(){img.parentNode.classList.toggle('big');});
  });
  var box=document.getElementById('only-failing');
  function filt(){document.body.classList.toggle('only-failing',!!(box&&box.checked));}
  if(box){box.addEventListener('change',filt);}
  var h=decodeURIComponent(location.hash.replace(/^#/,''));
  h.split('&').forEach(function(part){
    if(part==='failing'&&box){box.checked=true;filt();}
    var m=/^sort=(-?)([a-z_]+)$/.exec(part);
    if(m&&table){
      var th=table.querySelector('th[data-key="'+m[2]+'"]');
      if(th){th.click();if(m[1]){th.click();}}
    }
  });
  if(table){    // how the table lies in the window, for whoever checks the page's layout
    var sc=table.parentNode,row=table.tBodies[0].rows[0];
    var fits=sc.getBoundingClientRect().right<=document.documentElement.clientWidth+1;
    var stuck=row?getComputedStyle(row.cells[1]).position==='sticky':false;
    document.documentElement.setAttribute('data-table-layout',(fits?'fits':'wider')+' '+(stuck?'sticky':'flat')
      +' '+(sc.scrollWidth>sc.clientWidth?'scrolls':'whole'));
  }
  document.documentElement.setAttribute('data-ready','1');
})();
"""
