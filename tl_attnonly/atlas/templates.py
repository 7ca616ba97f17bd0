# ruff: noqa: E501  (the pages' JavaScript, kept in long lines)
"""The atlas site's pages: HTML with its CSS and JavaScript inline (no CDN; opens from file://).

Data reach the pages as JavaScript files that call a function with one JSON object
(``atlasIndex({...})``, ``atlasVocab([...])``, ``atlasShard({...})``): a browser loads a
``<script src>`` from ``file://`` where it refuses ``fetch``. :func:`page` fills a template.
A neuron page inflates its record's token ids with ``DecompressionStream`` (Chrome 80, Firefox
113, Safari 16.4 and later).
"""

from __future__ import annotations

import html

CSS = """
body{font-family:system-ui,sans-serif;margin:1.5em;max-width:70em;color:#222}
a{color:#1a5fb4}table{border-collapse:collapse;font-size:0.9em}
td,th{border-bottom:1px solid #ddd;padding:2px 8px;text-align:right}
th{cursor:pointer;background:#f4f4f4}td:first-child,th:first-child{text-align:left}
.ctx{font-family:monospace;white-space:pre-wrap;margin:2px 0;line-height:1.6}
.tok{border-radius:2px;padding:0 1px}.centre{outline:1px solid #000}
.muted{color:#777}.grid{display:flex;gap:2em;flex-wrap:wrap}
input{font-size:1em;padding:4px;width:24em}
"""

#: JavaScript every page shares: escaping, colouring by self weight, a sortable table.
COMMON_JS = r"""
function esc(s){return String(s).replace(/[&<>"]/g,c=>({'&':'&amp;','<':'&lt;','>':'&gt;','"':'&quot;'}[c]));}
function vis(s){return s.replace(/\n/g,'\u21b5').replace(/ /g,'\u00a0');}
function load(src,fail){var e=document.createElement('script');e.src=src;if(fail)e.onerror=fail;document.head.appendChild(e);}
function sortable(table){
  table.querySelectorAll('th').forEach(function(th,col){th.onclick=function(){
    var rows=Array.from(table.tBodies[0].rows),asc=th.dataset.asc!=='1';th.dataset.asc=asc?'1':'0';
    rows.sort(function(a,b){var x=a.cells[col].dataset.v||a.cells[col].textContent,
      y=b.cells[col].dataset.v||b.cells[col].textContent,nx=parseFloat(x),ny=parseFloat(y);
      var c=(isNaN(nx)||isNaN(ny))?x.localeCompare(y):nx-ny;return asc?c:-c;});
    rows.forEach(function(r){table.tBodies[0].appendChild(r);});};});
}
"""

#: The neuron page's renderer (``atlasShard`` is called by each data file of neurons).
NEURON_JS = r"""
var VOCAB=null,PENDING=null;
function atlasVocab(v){VOCAB=v;if(PENDING){atlasNeuron(PENDING);}}
function b64(s){var b=atob(s),a=new Uint8Array(b.length);for(var i=0;i<b.length;i++)a[i]=b.charCodeAt(i);return a;}
function inflate(a){return new Response(new Blob([a]).stream().pipeThrough(new DecompressionStream('deflate'))).arrayBuffer();}
function unpack(p){if(!p.n)return Promise.resolve([]);
  return inflate(b64(p.tokz)).then(function(buf){var tv=new DataView(buf),sb=b64(p.self),ab=new Int8Array(b64(p.a8).buffer),out=[];
  for(var i=0;i<p.n;i++){var c={tokens:[],acts:[],self:[],row:p.row[i],pos:p.pos[i],act:p.act[i]};
    for(var j=0;j<p.w;j++){var k=i*p.w+j,t=p.tb===4?tv.getInt32(4*k,true):tv.getUint16(2*k,true);
      c.tokens.push(p.tb===2&&t===65535?-1:t);c.acts.push(Math.round(ab[k]*p.as*1e4)/1e4);
      c.self.push(Math.round(sb[k]/255*1e4)/1e4);}
    out.push(c);}
  return out;});}
function unpackRecord(d){return unpack(d.pool).then(function(pool){var at=function(i){return pool[i];};
  d.top_examples=d.top_examples.map(at);d.examples_quantiles.forEach(function(q){q.examples=q.examples.map(at);});
  if(d.quadrants){for(var q in d.quadrants){d.quadrants[q].examples=d.quadrants[q].examples.map(at);}}
  d.histogram={edges:META.edges,counts:d.histogram.counts};return d;});}
function ctxHtml(c,before){
  var h='';c.tokens.forEach(function(t,j){if(t<0)return;var s=c.self[j];
    h+='<span class="tok'+(j===before?' centre':'')+'" style="background:rgba(220,50,32,'+s.toFixed(3)+
    ')" title="act '+c.acts[j]+', self '+s+'">'+esc(vis(VOCAB[t]))+'</span>';});
  return '<div class="ctx"><span class="muted">'+c.act.toFixed(3)+' &nbsp;</span>'+h+'</div>';
}
function logits(rows){return '<table>'+rows.map(function(r){return '<tr><td>'+esc(vis(r[0]))+
  '</td><td>'+r[1].toFixed(3)+'</td></tr>';}).join('')+'</table>';}
function atlasNeuron(d){if(!VOCAB){PENDING=d;return;}PENDING=null;unpackRecord(d).then(render);}
function render(d){
  if(location.hash&&location.hash.replace('#','')!==d.index)return;var B=META.before,h='';
  h+='<h1>'+d.index+'</h1><p><a href="index.html">index</a> · <a href="layer_'+d.layer+
    '.html">layer '+d.layer+'</a></p><p>fires (pre &gt; 0) on '+(100*d.activation_frequency).toFixed(3)+
    '% of '+d.n_tokens+' tokens · activation min '+d.act_min+', max '+d.act_max+', mean '+d.act_mean+'</p>';
  h+='<div class="grid"><div><h3>Top logits (W_out · W_U)</h3>'+logits(d.top_logits)+'</div><div><h3>Bottom logits</h3>'+
    logits(d.bottom_logits)+'</div><div><h3>Histogram</h3>'+hist(d.histogram)+'</div></div>';
  h+='<h2>Top contexts</h2><p class="muted">colour: the neuron-head\'s weight on itself (sigmoid(pre)); boxed: the top token</p>'+
    d.top_examples.map(function(c){return ctxHtml(c,B);}).join('');
  if(d.quadrants){h+='<h2>Gate / value sign quadrants</h2>';for(var q in d.quadrants){var Q=d.quadrants[q];
    h+='<h3>'+q+' ('+Q.count+' tokens)</h3>'+Q.examples.map(function(c){return ctxHtml(c,B);}).join('');}}
  h+='<h2>Quantile samples</h2>'+d.examples_quantiles.map(function(q){return '<h4>activation '+q.range[0]+
    ' to '+(q.range[1]===null?'\u221e':q.range[1])+'</h4>'+q.examples.map(function(c){return ctxHtml(c,B);}).join('');}).join('');
  document.getElementById('main').innerHTML=h;document.title=d.index;
}
function hist(hg){var m=Math.max.apply(null,hg.counts)||1,w=4,h=60,s='';
  hg.counts.forEach(function(c,i){var y=Math.round(h*Math.sqrt(c/m));s+='<rect x="'+(i*w)+'" y="'+(h-y)+
    '" width="'+(w-1)+'" height="'+y+'" fill="#1a5fb4"><title>['+hg.edges[i]+', '+hg.edges[i+1]+'): '+c+'</title></rect>';});
  return '<svg width="'+(hg.counts.length*w)+'" height="'+h+'">'+s+'</svg><div class="muted">bins uniform in asinh(act); height: sqrt(count)</div>';}
var WANT=null;
function missing(){document.getElementById('main').textContent='This atlas has no neuron '+location.hash.replace('#','')+'.';}
function atlasShard(s){var d=WANT!==null&&s[String(WANT)];if(d){atlasNeuron(d);}else{missing();}}
function show(){var m=/^#?L(\d+)N(\d+)$/.exec(location.hash),want=location.hash;if(!m){document.getElementById('main').textContent=
  'Name a neuron: neuron.html#L0N0';return;}WANT=+m[2];
  load('neurons/L'+m[1]+'/S'+Math.floor(WANT/META.shard)+'.js',function(){if(location.hash===want)missing();});}
window.addEventListener('hashchange',show);load('vocab.js');show();
"""

INDEX_JS = r"""
var IDX=null;
function atlasIndex(d){IDX=d;var h='';d.layers.forEach(function(l){h+='<li><a href="layer_'+l+'.html">layer '+l+'</a></li>';});
  document.getElementById('layers').innerHTML=h;search();}
function search(){if(!IDX)return;var q=document.getElementById('q').value,out=[],t=q.trim();
  var lab=/^L\d+N\d+$/i.test(t);
  IDX.neurons.forEach(function(n){if(out.length>=200)return;
    if(lab?n[0].toUpperCase()===t.toUpperCase():(t&&n[3].some(function(s){return s.trim()===t||s===q;})))out.push(n);});
  document.getElementById('hits').innerHTML=(t?out.length+' neuron(s)':'')+'<table><tbody>'+out.map(function(n){
    return '<tr><td><a href="neuron.html#'+n[0]+'">'+n[0]+'</a></td><td>'+(100*n[1]).toFixed(2)+'%</td><td>'+n[2]+
    '</td><td>'+n[3].map(function(s){return esc(vis(s));}).join(' | ')+'</td></tr>';}).join('')+'</tbody></table>';}
load('index.js');
"""

INDEX_BODY = """<h1>Neuron atlas: {model}</h1>
<p>{n_layers} layers x {d_mlp} neurons, {n_tokens} tokens. Search a neuron (L1N34) or a token
(the neurons whose top contexts centre on it).</p>
<input id="q" placeholder="L1N34 or a token" oninput="search()" autofocus>
<div id="hits"></div><h2>Layers</h2><ul id="layers"></ul>"""

LAYER_BODY = """<h1>{model}: layer {layer}</h1><p><a href="index.html">index</a></p>
<h3>Firing frequency (fraction of tokens with pre &gt; 0), neurons per bin of log10</h3>{density}
<table id="t"><thead><tr><th>neuron</th><th>fires</th><th>act max</th><th>act min</th>
<th>top tokens</th></tr></thead><tbody>{rows}</tbody></table>
<script>sortable(document.getElementById('t'));</script>"""


def page(title: str, body: str, script: str = "", data: str = "") -> str:
    """A whole page: ``body`` HTML, the shared CSS and JavaScript, then ``data`` and ``script``."""
    return (
        f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{CSS}</style><script>{COMMON_JS}</script></head><body>{body}"
        f"<script>{data}{script}</script></body></html>"
    )


__all__ = ["COMMON_JS", "CSS", "INDEX_BODY", "INDEX_JS", "LAYER_BODY", "NEURON_JS", "page"]
